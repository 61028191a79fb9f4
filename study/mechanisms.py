"""Each method's own mechanism, measured on a finished run: does the method work the way it says it does?

`measure(run_dir, data_root, split, limit)` reads a run directory of `python -m lightning_modules.fit`
(`config.yaml`, `export/`, `checkpoints/last.ckpt`) and a shapes world, and returns flat scalars. The
measurements of a method are chosen by its `method.name` through `MECHANISMS`:

- every CLIP fine-tuning method (clip_ft, clip_cae, macco, smartclip) -- the **attribution gap**, so that
  CAE can be compared with CLIP-FT: mean A_comp - A_obj (x100) over the first `limit` captions of the split
  (each with its own image), as the attribution monitor measures it (`lightning_modules.monitor`), for the
  attention and the gradient attribution, with the schema's default attribution options for every run (all
  layers, mean over heads, renormalised): one instrument for all runs, whatever a CAE run trained on.
  Keys `attr_gap_attention`, `attr_gap_gradient`, and `attr_gap_captions` (the captions with object and
  composition tokens that enter the mean). Measured on the export (the weights the study scores).
- macco -- **cross-modal reconstruction**: the trained module (config + last checkpoint) reconstructs the
  masked composition tokens (L_mlm) and the masked patches (L_mim) of the first `limit` samples of the split,
  once with each sample's own image / caption as the other modality and once with another image's (a fixed
  derangement that never pairs a caption with its own image). If the predictors use the other modality, the
  shuffled partner must hurt. Keys `mlm_loss_{true,shuffled}`, `mlm_acc_{true,shuffled}` (top-1 accuracy of
  the masked tokens, averaged per sample like L_mlm), `mim_loss_{true,shuffled}`, and the sample counts
  `mlm_samples` / `mim_samples` (samples with at least one masked token / patch). The samples come from the
  run's own DataModule (its tokenizer, cached masks, comp_mask rule, evaluation transform) with a fixed
  augmentation seed per sample, so the patch masks are the same at every measurement; the losses are the
  module's own (`MaccoCLIP.macco_forward`, `raw_losses`), unweighted. A split without a preprocessing cache
  (e.g. a test split) is preprocessed first, into the run's `preprocess.cache_root`.
- smartclip -- **the caption's mask**: the trained mask network's binary mask (m >= 0.5, the hard mask's ones)
  over the D embedding dimensions for the first `limit` captions of the split. Keys `active_dims` (mean
  active dimensions per caption), `active_fraction` (over D), and the mean Jaccard overlap of two captions'
  active dimensions: `mask_jaccard_same_image` (pairs of captions of one image), `mask_jaccard_other_image`
  (pairs of captions of different images) and `mask_jaccard_relation_flip` (a caption and its relation-flip
  hard negative, the annotation's `neg_captions` entry whose structure in the scene graphs is the caption with
  subject and object exchanged or the relation reversed), with `mask_relation_flip_pairs`. Two empty masks
  overlap with Jaccard 1 (the mask did not change). A key with no pair at all is left out, and logged.
- tflocal, tfglobal -- none ({}): their aligners re-rank the frozen model's features; the study compares them
  with the frozen global cosine on the same items from the per-item outcomes, not here.

Relative paths of the run's config (`preprocess.cache_root`, `model.config_dir`) resolve as they do for fit.
MACCO and SmartCLIP need the trained heads, which the export leaves out: a run without `checkpoints/last.ckpt`
is an error naming the run, and so is a checkpoint of another step than the export's. A non-finite value is an
error, never a NaN in the report.

The module is rebuilt as fit builds it (`fit.build_module`) from the run's config with random initial weights
(`model.pretrained` null, the open_clip name canonicalised as fit does) and every tensor is then loaded from
the checkpoint (strict), so no pretrained source needs to exist where the report runs. With a pretrained tag
of other normalisation constants than open_clip's defaults the image transform could differ; the shapes study
initialises from a local export, where it does not.
"""
from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from omegaconf import DictConfig
from torch import Tensor
from torch.utils.data import default_collate

from core.config import per_device_batch_size
from modeling.encoders import CLIPEncoders, canonical_model_name
from modeling.export import load_export, read_export_metadata
from datamodules.shapes import OPPOSITE_RELATION, load_scene_graphs
from evaluation.benchmarks.base import ImageRef
from evaluation.benchmarks.images import load_image
from lightning_modules import load_run_config
from lightning_modules.monitor import image_embeddings, make_probe, probe_attribution, summarise
from lightning_modules.resume import CHECKPOINT_DIR, LAST_CHECKPOINT, checked_checkpoint
from modeling.attribution import AttributionOptions
from modeling.losses import mean_over_masked_samples
from modeling.modular_losses import straight_through_mask
from parsers.scene_graph import SceneGraphParser

log = logging.getLogger(__name__)

Scalars = Dict[str, float]

# The attribution methods of the gap (CAE's attention attribution and the gradient one, as the monitor logs).
GAP_ATTRIBUTIONS = ("attention", "gradient")
# Augmentation seed of MACCO's measured samples: sample i draws its patch mask (phrase or random rectangle)
# from SeedSequence([MASK_SEED, i]), the same at every measurement and independent of the batching.
MASK_SEED = 0
# Seed of the random item order whose rotation is the shuffled-partner derangement.
DERANGEMENT_SEED = 0
# The fields of a sample that belong to its image (they move together to the shuffled partner).
IMAGE_FIELDS = ("image", "patch_mask", "image_id", "bad_image")
# Captions per forward of the SmartCLIP mask network.
MASK_CHUNK = 64


class MechanismError(RuntimeError):
    """A run cannot be measured (no checkpoint, a checkpoint of other weights than the export, no data)."""


# ----- the run -------------------------------------------------------------------------------------------
@dataclass
class Run:
    """A finished run directory of `lightning_modules.fit`."""

    directory: Path
    cfg: DictConfig  # the resolved config.yaml

    @property
    def method(self) -> str:
        return self.cfg.method.name

    @property
    def export_dir(self) -> Path:
        return self.directory / "export"

    @property
    def checkpoint(self) -> Path:
        return self.directory / CHECKPOINT_DIR / LAST_CHECKPOINT


def load_run(run_dir: Path) -> Run:
    """The run's resolved config (validated against the schema); a directory without one is an error."""
    config = Path(run_dir) / "config.yaml"
    if not config.is_file():
        raise MechanismError(f"run {run_dir}: no config.yaml (not a run directory of lightning_modules.fit)")
    return Run(Path(run_dir), load_run_config([config], base=None, saved=True))


def rebuild_config(cfg: DictConfig) -> DictConfig:
    """The run's config with random initial weights under the name fit built (the checkpoint holds the rest)."""
    cfg = copy.deepcopy(cfg)
    pretrained = cfg.model.pretrained
    cfg.model.name = canonical_model_name(cfg.model.name, pretrained if pretrained == "openai" else None)
    cfg.model.pretrained = None
    return cfg


def trained_module(run: Run, device: torch.device):
    """The run's LightningModule with every tensor of its last checkpoint, in eval mode on `device`."""
    from lightning_modules.fit import build_module  # Lightning and open_clip: imported when a module is needed

    if not run.checkpoint.is_file():
        raise MechanismError(f"run {run.directory}: no {CHECKPOINT_DIR}/{LAST_CHECKPOINT}; the {run.method} "
                             f"mechanism needs the trained heads, which the export leaves out")
    checkpoint = torch.load(checked_checkpoint(run.checkpoint), map_location="cpu", weights_only=False)
    check_same_weights_as_export(run, int(checkpoint.get("global_step", -1)))
    module = build_module(rebuild_config(run.cfg))
    module.load_state_dict(checkpoint["state_dict"], strict=True)
    return module.to(device).eval()


def check_same_weights_as_export(run: Run, checkpoint_step: int) -> None:
    """The checkpoint must hold the exported (scored) weights: both written at the same step."""
    if not run.export_dir.is_dir():
        return
    export_step = read_export_metadata(run.export_dir).get("global_step")
    if export_step is not None and export_step != checkpoint_step:
        raise MechanismError(f"run {run.directory}: {LAST_CHECKPOINT} is from step {checkpoint_step} but the export "
                             f"from step {export_step}; the mechanism would describe other weights than the scores")


# ----- the split -----------------------------------------------------------------------------------------
@dataclass
class SplitFiles:
    """Where one split of a shapes world is."""

    root: Path
    split: str

    @property
    def captions(self) -> Path:
        return self.root / "annotations" / f"captions_{self.split}.json"

    @property
    def images(self) -> Path:
        return self.root / "images" / self.split

    @property
    def scene_graphs(self) -> Path:
        return self.root / "annotations" / f"scene_graphs_{self.split}.json"

    def check(self) -> None:
        missing = [str(path) for path in (self.captions, self.images) if not path.exists()]
        if missing:
            raise MechanismError(f"split {self.split!r} of {self.root}: missing {', '.join(missing)}")


def first_annotations(files: SplitFiles, limit: int) -> Tuple[List[dict], Dict[int, str]]:
    """The first `limit` caption annotations of the split (file order) and the image file names by id."""
    coco = json.loads(files.captions.read_text())
    annotations = coco["annotations"][:limit]
    if not annotations:
        raise MechanismError(f"{files.captions} has no caption annotation")
    return annotations, {image["id"]: image["file_name"] for image in coco["images"]}


# ----- every CLIP fine-tuning run: the attribution gap --------------------------------------------------
def attribution_gaps(run: Run, files: SplitFiles, limit: int, device: torch.device) -> Scalars:
    """Mean A_comp - A_obj (x100) of the export over the first `limit` captions, per attribution method."""
    if not run.export_dir.is_dir():
        raise MechanismError(f"run {run.directory}: no export/ (the attribution gap is measured on the exported "
                             f"weights, written when fit ends)")
    built = load_export(run.export_dir)
    annotations, file_names = first_annotations(files, limit)
    captions = [annotation["caption"].strip() for annotation in annotations]
    images = torch.stack([built.preprocess_val(load_image(ImageRef(str(files.images / file_names[a["image_id"]]))))
                          for a in annotations])
    parser = SceneGraphParser(run.cfg.preprocess.parser_model, run.cfg.preprocess.parser_batch_size)
    probe = make_probe(captions, images, built.tokenizer(captions), built.tokenizer, parser.parse(captions),
                       files.split)
    if not bool(probe.valid.any()):
        raise MechanismError(f"run {run.directory}: none of the first {len(probe)} {files.split} captions has both "
                             f"object and composition tokens; the attribution gap is undefined")
    encoders = CLIPEncoders(built.model.to(device).eval())
    embeddings = image_embeddings(encoders, probe.images)
    gaps = {f"attr_gap_{method}": 100.0 * summarise(probe_attribution(encoders, probe, embeddings, method,
                                                                      AttributionOptions()), probe).scalars()["gap"]
            for method in GAP_ATTRIBUTIONS}
    return {**gaps, "attr_gap_captions": float(probe.valid.sum())}


# ----- MACCO: reconstruction with the true versus a shuffled partner -------------------------------------
def shuffled_partners(image_ids: Sequence[int], seed: int = DERANGEMENT_SEED) -> np.ndarray:
    """partner[i] != i with image_ids[partner[i]] != image_ids[i]: a fixed derangement of the items.

    The items in a seeded random order, each paired with the item s places further on (cyclically): a bijection
    without fixed points for any 0 < s < n; s is the smallest shift that pairs no item with its own image.
    """
    ids = np.asarray(image_ids)
    order = np.random.default_rng(seed).permutation(len(ids))
    for shift in range(1, len(ids)):
        partner = np.empty(len(ids), dtype=np.int64)
        partner[order] = np.roll(order, -shift)
        if not np.any(ids[partner] == ids):
            return partner
    raise MechanismError(f"no derangement of {len(ids)} items pairs every caption with another image (one image "
                         f"holds more than half of them, or there is only one image)")


def sample_seed(index: int) -> int:
    """The augmentation seed of measured sample `index` (crop and patch mask), as the training sampler derives one."""
    return int(np.random.SeedSequence([MASK_SEED, index]).generate_state(1)[0])


def split_config(cfg: DictConfig, files: SplitFiles, limit: int) -> DictConfig:
    """The run's config with its validation split pointed at the measured split (first `limit` samples)."""
    cfg = rebuild_config(cfg)
    cfg.data.root = str(files.root)
    cfg.data.val_annotations = str(files.captions.relative_to(files.root))
    cfg.data.val_images = str(files.images.relative_to(files.root))
    cfg.data.max_val_samples = limit
    cfg.preprocess.val_scene_graphs = (str(files.scene_graphs.relative_to(files.root))
                                       if files.scene_graphs.is_file() else None)
    return cfg


def ensure_mask_cache(cfg: DictConfig, split: str) -> None:
    """The preprocessing cache of the measured split (pointed at as the validation split), built when missing by
    the same idempotent job as `python -m datamodules.preprocess` (a split the study never preprocessed)."""
    from datamodules.cache import CacheError, open_cache
    from datamodules.preprocess import (build_parser, find_cache_directory, make_grounder, preprocess_split,
                                        split_sources)

    source = replace(next(s for s in split_sources(cfg.data, cfg.preprocess) if s.split == "val"), split=split)
    parser, grounder = build_parser(cfg.preprocess), make_grounder(cfg.data, cfg.preprocess)
    try:
        open_cache(find_cache_directory(cfg.preprocess.cache_root, source, parser, grounder))
    except CacheError:
        log.info("mechanisms: preprocessing the %s split for MACCO's masks (cache root %s)", split,
                 cfg.preprocess.cache_root)
        preprocess_split(cfg, source, parser, grounder)


def macco_samples(module, cfg: DictConfig, split: str) -> List[dict]:
    """The measured samples from the run's own DataModule (as a validation split), seeded per sample."""
    from lightning_modules.fit import build_datamodule

    if not cfg.data.masks:
        raise MechanismError("MACCO's reconstruction needs data.masks=true (comp_mask and patch_mask)")
    ensure_mask_cache(cfg, split)
    datamodule = build_datamodule(cfg, module)
    datamodule.setup("validate")
    dataset = datamodule.val_dataset
    return [dataset[(index, sample_seed(index))] for index in range(len(dataset))]


def with_partner_images(samples: Sequence[dict], partner: np.ndarray) -> List[dict]:
    """Each sample's caption fields with the image fields (pixels, patch mask, id) of sample partner[i]."""
    return [{**sample, **{key: samples[int(j)][key] for key in IMAGE_FIELDS if key in sample}}
            for sample, j in zip(samples, partner)]


@torch.no_grad()
def reconstruction(module, batch: dict) -> Dict[str, Tuple[float, float]]:
    """(value, samples) of unweighted L_mlm, masked-token accuracy and L_mim on one batch, by the module's own
    forward and losses; `samples` counts the samples with a masked token / patch (each value's mean runs over
    them, so values of several batches combine exactly by these weights)."""
    out = module.macco_forward(batch)
    raw = module.raw_losses(out, batch["image"])
    correct = (out.vocabulary_logits.argmax(dim=-1) == out.ids[out.text_mask]).float()
    per_token = torch.zeros(out.text_mask.shape, device=correct.device).masked_scatter(out.text_mask, correct)
    text_samples = float(out.text_mask.any(dim=1).sum())
    patch_samples = float(out.patch_mask.any(dim=1).sum())
    return {"mlm_loss": (float(raw["mlm"]), text_samples),
            "mlm_acc": (float(mean_over_masked_samples(per_token, out.text_mask)), text_samples),
            "mim_loss": (float(raw["mim"]), patch_samples)}


def batches(samples: Sequence[dict], batch_size: int, device: torch.device):
    """Collated batches (the DataLoader's default collate) on `device`."""
    for start in range(0, len(samples), batch_size):
        batch = default_collate(list(samples[start:start + batch_size]))
        yield {key: value.to(device) if isinstance(value, Tensor) else value for key, value in batch.items()}


def mean_reconstruction(module, samples: Sequence[dict], batch_size: int,
                        device: torch.device) -> Tuple[Scalars, Scalars]:
    """`reconstruction` over all samples: per-batch values weighted by their sample counts; (means, counts)."""
    sums: Dict[str, float] = {}
    counts: Dict[str, float] = {}
    for batch in batches(samples, batch_size, device):
        for name, (value, samples_in_batch) in reconstruction(module, batch).items():
            sums[name] = sums.get(name, 0.0) + value * samples_in_batch
            counts[name] = counts.get(name, 0.0) + samples_in_batch
    empty = [name for name, count in counts.items() if count == 0]
    if empty:
        raise MechanismError(f"MACCO reconstruction: no measured sample has a masked token / patch for {empty}")
    return {name: sums[name] / counts[name] for name in sums}, counts


def macco_reconstruction(run: Run, files: SplitFiles, limit: int, device: torch.device) -> Scalars:
    """L_mlm, masked-token accuracy and L_mim with each sample's own partner modality and with a shuffled one."""
    module = trained_module(run, device)
    cfg = split_config(run.cfg, files, limit)
    samples = macco_samples(module, cfg, files.split)
    partner = shuffled_partners([sample["image_id"] for sample in samples])
    batch_size = per_device_batch_size(cfg.data, validation=True)
    true, counts = mean_reconstruction(module, samples, batch_size, device)
    shuffled, _ = mean_reconstruction(module, with_partner_images(samples, partner), batch_size, device)
    counts = {"mlm_samples": counts["mlm_loss"], "mim_samples": counts["mim_loss"]}
    return {**{f"{name}_true": value for name, value in true.items()},
            **{f"{name}_shuffled": value for name, value in shuffled.items()}, **counts}


# ----- SmartCLIP: the caption's mask over the embedding dimensions ---------------------------------------
def jaccard(a: Tensor, b: Tensor) -> Tensor:
    """Jaccard overlap of the rows of two bool tensors [N, D] -> [N]; two empty rows overlap with 1."""
    intersection = (a & b).sum(dim=-1).float()
    union = (a | b).sum(dim=-1).float()
    return torch.where(union > 0, intersection / union.clamp(min=1), torch.ones_like(union))


def jaccard_matrix(masks: Tensor) -> Tensor:
    """Jaccard overlap of every pair of rows of a bool [N, D] -> [N, N], by matrix products."""
    m = masks.float()
    intersection = m @ m.T
    sizes = m.sum(dim=1)
    union = sizes[:, None] + sizes[None, :] - intersection
    return torch.where(union > 0, intersection / union.clamp(min=1), torch.ones_like(union))


def pair_means(overlap: Tensor, image_ids: Sequence[int]) -> Dict[str, Tuple[Optional[float], int]]:
    """(mean, pairs) of an [N, N] overlap over the unordered caption pairs of one image and of two images
    (mean None without a pair)."""
    ids = torch.as_tensor(list(image_ids))
    upper = torch.ones_like(overlap, dtype=torch.bool).triu(diagonal=1)
    same = ids[:, None] == ids[None, :]
    result = {}
    for name, pairs in (("same_image", upper & same), ("other_image", upper & ~same)):
        count = int(pairs.sum())
        result[name] = (float(overlap[pairs].mean()) if count else None, count)
    return result


@torch.no_grad()
def active_masks(module, captions: Sequence[str]) -> Tensor:
    """The trained mask network's mask of each caption as bool [N, D]: m >= 0.5 (the hard mask's ones)."""
    parts = []
    for start in range(0, len(captions), MASK_CHUNK):
        ids = module.tokenizer(list(captions[start:start + MASK_CHUNK])).to(module.device)
        _, hidden, valid = module.encode_text_with_hidden(ids)
        masks = straight_through_mask(module.mask_net(hidden, valid), hard=module.cfg.method.hard_mask)
        parts.append((masks >= 0.5).cpu())
    return torch.cat(parts)


def same_relation_flip(caption: dict, negative: dict) -> bool:
    """`negative` (a structure of the scene graphs) is `caption` with subject and object exchanged or with the
    relation reversed: the shapes world's relation-flip negatives (an absent-colour fallback is not one)."""
    if caption.get("relation") is None:
        return False
    exchanged = {**caption, "subject": caption["object"], "object": caption["subject"]}
    reversed_ = {**caption, "relation": OPPOSITE_RELATION[caption["relation"]]}
    return negative in (exchanged, reversed_)


def relation_flip_captions(files: SplitFiles, annotations: Sequence[dict]) -> Dict[int, str]:
    """Caption id -> the text of its relation-flip hard negative, for the captions that have one."""
    if not files.scene_graphs.is_file():
        log.warning("mechanisms: no %s; the relation-flip mask overlap is left out", files.scene_graphs)
        return {}
    flip_index = {}
    for image in load_scene_graphs(files.root, files.split):
        for caption in image["captions"]:
            found = [k for k, negative in enumerate(caption["neg_structures"])
                     if same_relation_flip(caption["structure"], negative)]
            if found:
                flip_index[caption["caption_id"]] = found[0]
    return {a["id"]: a["neg_captions"][flip_index[a["id"]]] for a in annotations if a["id"] in flip_index}


def smartclip_masks(run: Run, files: SplitFiles, limit: int, device: torch.device) -> Scalars:
    """Active mask dimensions per caption and the masks' Jaccard overlaps (see the module docstring)."""
    module = trained_module(run, device)
    annotations, _ = first_annotations(files, limit)
    masks = active_masks(module, [annotation["caption"].strip() for annotation in annotations])
    active = masks.sum(dim=1).float()
    result = {"active_dims": float(active.mean()), "active_fraction": float(active.mean()) / masks.shape[1]}
    for name, (mean, pairs) in pair_means(jaccard_matrix(masks), [a["image_id"] for a in annotations]).items():
        result.update(overlap_entry(f"mask_jaccard_{name}", mean, pairs))
    flips = relation_flip_captions(files, annotations)
    rows = [row for row, annotation in enumerate(annotations) if annotation["id"] in flips]
    if rows:
        flipped = active_masks(module, [flips[annotations[row]["id"]] for row in rows])
        result.update(overlap_entry("mask_jaccard_relation_flip", float(jaccard(masks[rows], flipped).mean()),
                                    len(rows)))
    else:
        log.warning("mechanisms: none of the first %d %s captions has a relation-flip negative", len(annotations),
                    files.split)
    return {**result, "mask_relation_flip_pairs": float(len(rows))}


def overlap_entry(key: str, mean: Optional[float], pairs: int) -> Scalars:
    """{key: mean}, or {} (logged) when there is no pair to average over."""
    if pairs == 0:
        log.warning("mechanisms: no caption pair for %s; left out", key)
        return {}
    return {key: mean}


# ----- the registry and the entry point ------------------------------------------------------------------
Measurement = Callable[[Run, SplitFiles, int, torch.device], Scalars]

# Method name -> its measurements. Every method of `lightning_modules.METHODS` has an entry (a test checks it).
MECHANISMS: Dict[str, Tuple[Measurement, ...]] = {
    "clip_ft": (attribution_gaps,),
    "clip_cae": (attribution_gaps,),
    "macco": (attribution_gaps, macco_reconstruction),
    "smartclip": (attribution_gaps, smartclip_masks),
    # Aligners over the frozen model: compared with the frozen cosine per item by the study report.
    "tflocal": (),
    "tfglobal": (),
}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def measure(run_dir: Path, data_root: Path, split: str, limit: int = 256,
            device: Optional[str] = None) -> Scalars:
    """The mechanism scalars of one finished run on the first `limit` items of `split` (see the module doc).

    Args:
        run_dir: a run directory of `lightning_modules.fit`.
        data_root: the shapes world (`annotations/captions_<split>.json`, `images/<split>/`, scene graphs).
        split: the split to measure on (e.g. "val").
        limit: the first N captions / samples of the split.
        device: torch device; default CUDA when available, else the CPU.

    Raises:
        MechanismError: the run cannot be measured (named in the message); KeyError: an unregistered method.
    """
    if limit < 1:
        raise ValueError(f"limit must be positive, got {limit}")
    run = load_run(Path(run_dir))
    if run.method not in MECHANISMS:
        raise KeyError(f"run {run_dir}: no mechanism registered for method {run.method!r}; registered: "
                       f"{', '.join(sorted(MECHANISMS))}")
    measurements = MECHANISMS[run.method]
    if not measurements:
        return {}
    files = SplitFiles(Path(data_root), split)
    files.check()
    device_ = torch.device(device) if device else default_device()
    result: Scalars = {}
    for measurement in measurements:
        try:
            result.update(measurement(run, files, limit, device_))
        except MechanismError as err:
            if f"run {run.directory}" in str(err):
                raise
            raise MechanismError(f"run {run.directory}: {err}") from err
    check_finite(result, run.directory)
    return result


def check_finite(result: Scalars, run_dir: Path) -> None:
    bad = {key: value for key, value in result.items() if not np.isfinite(value)}
    if bad:
        raise MechanismError(f"run {run_dir}: non-finite mechanism values {bad}")

"""Frozen-backbone features, computed once: `python -m datamodules.features --config FILE [--shard i/n] [k=v ...]`.

The TFLocal / TFGlobal aligners (lightning_modules/methods/tflocal.py) train on a frozen CLIP, so its outputs are a
function of the data alone: this offline job encodes every image and caption of the configured train / val
splits once and caches, per caption,

    text tokens     [L_i, D]   projected, trimmed to the caption's EOS (L_i = SOT + words + EOS), float16
    text global     [D]        the projected EOS token (= `encode_text`), float32
    neg tokens      [K][L, D]  the same for each of its K hard-negative captions (method.hard_negatives.captions)
and per image (stored once, shared by its captions)
    image tokens    [1 + P, D] the global embedding (= the projected CLS for token pooling) then the
                               projected patches, float16
    image global    [D]        float32.

float16 on disk halves the size (COCO train at ViT-B/32: ~6 GB of image tokens, ~9 GB of text tokens); the
tokens are LayerNorm-ed by the aligner's input layer, so their 3 significant digits are plenty. Images are
decoded by `parsers.images` (as training, grounding and the benchmarks decode them) and encoded with the
deterministic evaluation transform: there is one cached view per image, no augmentation.

The store is datamodules/cache.py's `ShardedCache` with tensors as the payload (`FeatureShards`): the same
shard / checksum / manifest conventions and the same `--shard` loop as the preprocessing cache. Layout:

    <data.features_cache>/<key>/
        settings.json                    what the key hashes: backbone weights, annotation file, split options
        shard-00003-of-00012.pt          torch.save of the shard's tensors (written atomically)
        shard-00003-of-00012.json        its sha256, caption count and counts
        manifest.json                    counts over finished shards and whether all are done

The key hashes the backbone's weights (`backbone_fingerprint`), so a cache can never be read by a module
whose frozen CLIP differs from the one that produced it. Captions are sorted by (image, caption) and cut into
`preprocess.shard_size` captions per shard; rerunning skips finished shards, and `--shard i/n` splits the work.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import lightning as L
import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from core.cli import add_key_values
from core.config import per_device_batch_size
from datamodules.annotations import CaptionRecord, existing_path, image_path_candidates, read_annotation_file
from datamodules.cache import (CacheError, ShardedCache, add_shard_argument, cache_key, file_sha256, fill_shards,
                              open_cache, resolve_device, shard_count)
from datamodules.coco import (IMAGE_ERRORS, build_dataloader, check_enough_samples, cycled_negative_rows,
                              find_truncated, read_image_ids, tokenize_captions, trainer_epoch_position)
from datamodules.inputs import InputError, check_feature_inputs
from parsers.images import read_rgb_file

log = logging.getLogger("datamodules.features")

FEATURE_FORMAT_VERSION = 1
TOKEN_DTYPE = torch.float16
FEATURE_COUNT_KEYS = ("captions", "images", "truncated", "unreadable_images", "dropped_captions")
SPLITS = ("train", "val")


# ----- what the frozen backbone computes (shared with the module's on-the-fly path and the scorer) ------------
def caption_lengths(ids: Tensor) -> Tensor:
    """Tokens up to and including EOS, [B]: open_clip's EOS has the largest id (as `encode_text(trim=True)`)."""
    return ids.argmax(dim=-1) + 1


def length_mask(lengths: Tensor, max_length: int) -> Tensor:
    """bool [B, max_length]: True at the first `lengths[b]` positions (real tokens)."""
    return torch.arange(max_length, device=lengths.device)[None, :] < lengths[:, None]


@torch.no_grad()
def frozen_image_features(encoders, images: Tensor) -> Tuple[Tensor, Tensor]:
    """(tokens [B, 1 + P, D], global [B, D]) of a `CLIPEncoders`: the global embedding then the patches.

    For CLIP's token pooling the global embedding is exactly the projected CLS token, so the first row is
    "CLS" in the aligner's [CLS; P] image token set (docs/methods.md#tflocal-and-tfglobal).
    """
    features = encoders.encode_image(images)
    return torch.cat([features.pooled[:, None], features.patches], dim=1), features.pooled


@torch.no_grad()
def frozen_text_features(encoders, ids: Tensor, trim: Union[bool, int] = True) -> Tuple[Tensor, Tensor, Tensor]:
    """(tokens [B, L, D] trimmed after the batch's last EOS, lengths [B], global [B, D]) of a `CLIPEncoders`
    (`trim`: `encode_text`'s, True or the length measured on the host)."""
    features = encoders.encode_text(ids, trim=trim)
    return features.tokens, caption_lengths(ids), features.pooled


def backbone_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over the model's parameters (names, shapes, fp32 bytes): which frozen weights made a feature."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        values = param.detach().float().cpu().contiguous()
        digest.update(f"{name}:{tuple(values.shape)}".encode())
        digest.update(values.numpy().tobytes())
    return digest.hexdigest()


def backbone_identity(model_name: str, model: torch.nn.Module) -> Dict[str, Any]:
    """What identifies the features of a backbone: its name, weights and image transform."""
    preprocess = getattr(model.visual, "preprocess_cfg", {})
    return {"model": model_name, "weights_sha256": backbone_fingerprint(model),
            "image": json.loads(json.dumps(preprocess, default=str))}


# ----- the splits and their cache directories -----------------------------------------------------------------
@dataclass
class FeatureSplit:
    """One split's captions, images and selection options (the same options CocoDataModule applies)."""

    split: str
    annotations: Path
    images: Path
    karpathy_splits: Tuple[str, ...]
    num_hard_negatives: int
    max_samples: Optional[int]
    exclude_image_ids: Optional[str]
    caption_field: str = "caption"  # `data.caption_field`: the features must describe the captions trained on

    def settings(self, backbone: Dict[str, Any], on_bad_image: str, shard_size: int) -> Dict[str, Any]:
        """Everything that changes this split's cached features (the cache key hashes it)."""
        excluded = file_sha256(self.exclude_image_ids) if self.exclude_image_ids else None
        return {"format": FEATURE_FORMAT_VERSION, "backbone": backbone,
                "annotations_sha256": file_sha256(self.annotations), "karpathy_splits": list(self.karpathy_splits),
                "num_hard_negatives": self.num_hard_negatives, "max_samples": self.max_samples,
                "exclude_image_ids_sha256": excluded, "on_bad_image": on_bad_image, "shard_size": shard_size,
                "token_dtype": str(TOKEN_DTYPE),
                **({"caption_field": self.caption_field} if self.caption_field != "caption" else {})}


def feature_splits(cfg) -> List[FeatureSplit]:
    """The configured splits (`data` config section, hard-negative captions from `method.hard_negatives`);
    validation keeps no hard negatives, as CocoDataModule."""
    data, root = cfg.data, Path(cfg.data.root)
    splits = []
    for split in SPLITS:
        annotations = data[f"{split}_annotations"]
        if not annotations:
            continue
        train = split == "train"
        splits.append(FeatureSplit(split, root / annotations, root / data[f"{split}_images"],
                                   tuple(data[f"{split}_karpathy_splits"]),
                                   cfg.method.hard_negatives.captions if train else 0, data[f"max_{split}_samples"],
                                   data.exclude_image_ids if train else None, data.caption_field))
    return splits


def features_root(data) -> Path:
    if not data.features_cache:
        raise ValueError("data.features_cache is not set: the frozen-backbone methods read cached features "
                         "from that folder (python -m datamodules.features --config ... writes them)")
    return Path(data.features_cache)


def split_cache_dir(cfg, split: FeatureSplit, backbone: Dict[str, Any]) -> Path:
    settings = split.settings(backbone, cfg.data.on_bad_image, cfg.preprocess.shard_size)
    return features_root(cfg.data) / cache_key(settings)


# ----- the sharded store --------------------------------------------------------------------------------------
class FeatureShards(ShardedCache):
    """`ShardedCache` whose shards are dicts of tensors (torch.save) instead of JSON lines."""

    data_suffix = "pt"
    count_keys = FEATURE_COUNT_KEYS
    label = "feature cache"
    job = "python -m datamodules.features"

    def encode(self, payload: Dict[str, Tensor]) -> Tuple[bytes, int]:
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        return buffer.getvalue(), int(len(payload["caption_ids"]))

    def decode(self, path: Path, expected: int) -> Dict[str, Tensor]:
        """The tensors, memory-mapped (forked workers share pages)."""
        payload = torch.load(path, mmap=True, weights_only=True)
        if len(payload["caption_ids"]) != expected:
            raise CacheError(f"corrupt feature shard {path}: {len(payload['caption_ids'])} captions, expected "
                             f"{expected}")
        return payload


def open_feature_cache(directory: Path) -> FeatureShards:
    """A finished feature cache (for this backbone and data); a missing or incomplete one is a clear error."""
    return open_cache(directory, FeatureShards)


# ----- the offline job: records of a split --------------------------------------------------------------------
def split_records(split: FeatureSplit, on_bad_image: str) -> Tuple[List[CaptionRecord], List[str], int]:
    """(records sorted by image then caption, each record's image path, captions dropped).

    The same selection as `CocoCaptions`: the first `max_samples` annotations, then excluded images, empty
    captions and missing images removed (the last two raise with `on_bad_image="error"`).
    """
    records = read_annotation_file(str(split.annotations), split.karpathy_splits,
                                   split.caption_field)[:split.max_samples]
    excluded = read_image_ids(split.exclude_image_ids)
    records = [r for r in records if r.image_id not in excluded and _has_caption(r, on_bad_image, split)]
    paths = {r.file_name: existing_path(image_path_candidates(str(split.images), r.file_name)) for r in records}
    missing = sorted(name for name, path in paths.items() if path is None)
    if missing and on_bad_image == "error":
        raise FileNotFoundError(f"{len(missing)} image file(s) referenced by {split.annotations} are missing "
                                f"under {split.images}; the first: {missing[0]} (data.on_bad_image=skip drops them)")
    kept = sorted((r for r in records if paths[r.file_name] is not None), key=lambda r: (r.image_id, r.caption_id))
    return kept, [paths[r.file_name] for r in kept], len(records) - len(kept)


def _has_caption(record: CaptionRecord, on_bad_image: str, split: FeatureSplit) -> bool:
    if not record.caption and on_bad_image == "error":
        raise ValueError(f"{split.annotations}: annotation {record.caption_id} has an empty caption; set "
                         f"data.on_bad_image=skip to drop it")
    return bool(record.caption)


# ----- the offline job: encoding one shard --------------------------------------------------------------------
@dataclass
class FrozenBackbone:
    """The frozen CLIP the job encodes with, and how (`encoders` is a `CLIPEncoders` in eval mode)."""

    encoders: Any
    tokenizer: Any
    preprocess: Any
    device: torch.device
    batch_size: int
    num_workers: int
    on_bad_image: str


class _ImageFiles(Dataset):
    """Preprocessed images; an unreadable one is (zeros, False) with on_bad_image="skip", else an error."""

    def __init__(self, paths: Sequence[str], preprocess, on_bad_image: str):
        self.paths, self.preprocess, self.on_bad_image = list(paths), preprocess, on_bad_image

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Tuple[Tensor, bool]:
        try:
            # the decoder of training and grounding: a 16-bit image is scaled here as it is there, not clipped
            return self.preprocess(read_rgb_file(self.paths[index])), True
        except IMAGE_ERRORS as err:
            if self.on_bad_image == "error":
                raise OSError(f"cannot read image {self.paths[index]}: {err} (data.on_bad_image=skip drops "
                              f"its captions)") from err
            log.warning("cannot read image %s (%s): its captions are left out of the cache", self.paths[index], err)
            return self.preprocess(Image.new("RGB", (8, 8))), False


def encode_images(backbone: FrozenBackbone, paths: Sequence[str], progress: Optional[tqdm] = None
                  ) -> Tuple[Tensor, Tensor, Tensor]:
    """(tokens float16 [N, 1 + P, D], global float32 [N, D], readable bool [N]) of image files; `progress`
    advances by each batch's images."""
    loader = DataLoader(_ImageFiles(paths, backbone.preprocess, backbone.on_bad_image),
                        batch_size=backbone.batch_size, num_workers=backbone.num_workers)
    tokens, globals_, readable = [], [], []
    for pixels, ok in loader:
        image_tokens, image_global = frozen_image_features(backbone.encoders, pixels.to(backbone.device))
        tokens.append(image_tokens.to(TOKEN_DTYPE).cpu())
        globals_.append(image_global.float().cpu())
        readable.append(ok)
        if progress is not None:
            progress.update(len(ok))
    return torch.cat(tokens), torch.cat(globals_), torch.cat(readable)


def encode_texts(backbone: FrozenBackbone, ids: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(flat tokens float16 [sum L_i, D], offsets int64 [N + 1], global float32 [N, D]) of token ids [N, 77].

    Each caption keeps its own L_i = EOS index + 1 rows (no padding on disk).
    """
    flat, lengths, globals_ = [], [], []
    for start in range(0, len(ids), backbone.batch_size):
        batch = ids[start:start + backbone.batch_size].to(backbone.device)
        tokens, batch_lengths, text_global = frozen_text_features(backbone.encoders, batch)
        keep = length_mask(batch_lengths, tokens.shape[1])
        flat.append(tokens[keep].to(TOKEN_DTYPE).cpu())  # row-major: caption by caption, positions in order
        lengths.append(batch_lengths.cpu())
        globals_.append(text_global.float().cpu())
    lengths = torch.cat(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return torch.cat(flat), offsets, torch.cat(globals_)


def negative_captions(records: Sequence[CaptionRecord], num_negatives: int, source: Path) -> List[str]:
    """K negatives per caption, flat [N * K], each caption cycling its own list: a fixed choice, encoded once
    (`CocoCaptions` draws them at random at every access, as NegCLIP does)."""
    chosen = [record.neg_captions[:num_negatives] for record in records]
    lacking = sum(1 for negatives in chosen if not negatives)
    if lacking:
        raise ValueError(f"{source}: {lacking} of {len(records)} annotations have no neg_captions, but "
                         f"method.hard_negatives.captions={num_negatives}")
    counts = np.array([len(negatives) for negatives in chosen], dtype=np.int64)
    flat = [caption for negatives in chosen for caption in negatives]
    return [flat[row] for row in cycled_negative_rows(counts, num_negatives).reshape(-1)]


def encode_shard(backbone: FrozenBackbone, records: Sequence[CaptionRecord], paths: Sequence[str],
                 split: FeatureSplit, progress: Optional[tqdm] = None) -> Tuple[Dict[str, Tensor], Dict[str, int]]:
    """The tensors of one shard (see the module docstring) and its counts; `progress` counts its images."""
    image_paths = list(dict.fromkeys(paths))
    image_tokens, image_global, readable = encode_images(backbone, image_paths, progress)
    row_of = {path: row for row, path in enumerate(image_paths)}
    keep = [i for i, path in enumerate(paths) if bool(readable[row_of[path]])]
    records = [records[i] for i in keep]
    captions = [record.caption for record in records]
    ids = tokenize_captions(backbone.tokenizer, captions)
    text_tokens, text_offsets, text_global = encode_texts(backbone, torch.from_numpy(ids).long())
    payload = {
        "caption_ids": torch.tensor([r.caption_id for r in records], dtype=torch.int64),
        "image_ids": torch.tensor([r.image_id for r in records], dtype=torch.int64),
        "image_rows": torch.tensor([row_of[paths[i]] for i in keep], dtype=torch.int64),
        "truncated": torch.from_numpy(find_truncated(backbone.tokenizer, captions, ids)),
        "image_tokens": image_tokens, "image_global": image_global,
        "text_tokens": text_tokens, "text_offsets": text_offsets, "text_global": text_global,
    }
    if split.num_hard_negatives > 0:
        negatives = negative_captions(records, split.num_hard_negatives, split.annotations)
        neg_ids = torch.from_numpy(tokenize_captions(backbone.tokenizer, negatives)).long()
        neg_tokens, neg_offsets, neg_global = encode_texts(backbone, neg_ids)
        payload.update(neg_tokens=neg_tokens, neg_offsets=neg_offsets,
                       neg_global=neg_global.view(len(records), split.num_hard_negatives, -1))
    counts = {"captions": len(records), "images": int(readable.sum()), "truncated": int(payload["truncated"].sum()),
              "unreadable_images": int((~readable).sum()), "dropped_captions": len(paths) - len(records)}
    return payload, counts


# ----- the offline job: a split, and the command line ---------------------------------------------------------
def cache_split(cfg, split: FeatureSplit, backbone: FrozenBackbone, identity: Dict[str, Any],
                shard: Tuple[int, int] = (0, 1)) -> dict:
    """Encode this worker's unfinished shards of one split; return the (re)written manifest."""
    records, paths, dropped = split_records(split, cfg.data.on_bad_image)
    if not records:
        raise ValueError(f"{split.annotations}: no caption left to cache for the {split.split} split")
    size = cfg.preprocess.shard_size
    settings = split.settings(identity, cfg.data.on_bad_image, size)
    cache = FeatureShards(features_root(cfg.data) / cache_key(settings), shard_count(len(records), size))
    todo = cache.unfinished(shard)
    log.info("%s: %d captions (%d dropped: missing images / empty captions), %d shards, %d to do here, cache %s",
             split.split, len(records), dropped, cache.num_shards, len(todo), cache.directory)
    # Per image, not per shard: a 5,000-caption shard is minutes of encoding. Images are the slow part (the
    # texts of a shard take a fraction of its images' time); an image whose captions straddle two shards is
    # encoded (and counted) in both.
    total = sum(shard_image_count(paths, i, size) for i in todo)
    with tqdm(total=total, desc=f"features {split.split}", unit="image", mininterval=2.0) as progress:
        return fill_shards(cache, settings, todo, lambda index: encode_shard(
            backbone, records[index * size:(index + 1) * size], paths[index * size:(index + 1) * size], split,
            progress))


def shard_image_count(paths: Sequence[str], index: int, size: int) -> int:
    """Distinct images of shard `index` (its captions' image paths), as `encode_shard` encodes them."""
    return len(set(paths[index * size:(index + 1) * size]))


def build_frozen_backbone(cfg) -> Tuple[FrozenBackbone, Dict[str, Any]]:
    """The configured CLIP, built exactly as the training module builds it (same seed for a random init)."""
    from modeling.encoders import CLIPEncoders, build_model  # the model code; the DataModule needs none

    L.seed_everything(cfg.seed, workers=True)  # fit seeds the same way before building the module
    built = build_model(cfg.model.name, cfg.model.pretrained, cfg.model.config_dir)
    device = torch.device(resolve_device(cfg.preprocess.device))
    encoders = CLIPEncoders(built.model).to(device).eval().requires_grad_(False)
    backbone = FrozenBackbone(encoders, built.tokenizer, built.preprocess_val, device,
                              per_device_batch_size(cfg.data, validation=True), cfg.data.num_workers,
                              cfg.data.on_bad_image)
    return backbone, backbone_identity(built.name, built.model)


def run(cfg, shard: Tuple[int, int] = (0, 1)) -> Dict[str, dict]:
    """Cache the features of every configured split; return the manifest of each.

    Raises:
        InputError: a missing input (checked before the backbone is built or anything is written).
    """
    check_feature_inputs(cfg)
    backbone, identity = build_frozen_backbone(cfg)
    return {split.split: cache_split(cfg, split, backbone, identity, shard) for split in feature_splits(cfg)}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=[], help="experiment YAML(s), as for fit")
    add_shard_argument(parser)
    add_key_values(parser, help="config overrides, e.g. data.features_cache=/scratch/f")
    # Options and overrides may interleave (`--config a.yaml k=v --config b.yaml k2=v2`); every --config file
    # still merges before every override, each in the order given.
    return parser.parse_intermixed_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    from core.config import load_config_or_exit

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        manifests = run(load_config_or_exit(args.config, args.overrides), args.shard)
    except InputError as err:
        raise SystemExit(f"error: {err}") from None
    for split, manifest in manifests.items():
        log.info("%s: %d of %d shards finished, %s", split, manifest["finished_shards"], manifest["num_shards"],
                 manifest["counts"])


# ----- reading: the dataset and the DataModule ----------------------------------------------------------------
class FeatureCaptions(Dataset):
    """One sample per cached caption; the `CocoCaptions` sample with features in place of pixels and ids.

    A sample: `image` float16 [1 + P, D] (image tokens), `image_global` [D], `text` float16 [L, D] (the
    caption's tokens zero-padded to the split's longest caption L), `text_mask` bool [L] (True = real token),
    `text_global` [D], `caption_id`, `image_id`, `truncated`; with K hard negatives also `neg_text`
    [K, L_neg, D], `neg_text_mask` [K, L_neg] and `neg_text_global` [K, D]. The module trims each batch to its
    own longest caption, so the fixed padding costs copying only.
    """

    def __init__(self, cache: FeatureShards):
        self.directory = cache.directory
        self.shards = [cache.read_shard(i) for i in range(cache.num_shards)]
        counts = [len(shard["caption_ids"]) for shard in self.shards]
        self._shard = np.repeat(np.arange(len(counts)), counts)
        self._row = np.concatenate([np.arange(count) for count in counts])
        self.text_length = max(int(shard["text_offsets"].diff().max()) for shard in self.shards)
        first = self.shards[0]
        self.num_hard_negatives = first["neg_global"].shape[1] if "neg_global" in first else 0
        self.neg_text_length = (max(int(shard["neg_offsets"].diff().max()) for shard in self.shards)
                                if self.num_hard_negatives else 0)

    def __len__(self) -> int:
        return len(self._row)

    def __getitem__(self, key) -> Dict[str, Any]:
        """Sample `key`, or `(index, augmentation_seed)` from `SeededDistributedSampler` (the seed is unused)."""
        index = key[0] if isinstance(key, tuple) else key
        shard, row = self.shards[self._shard[index]], int(self._row[index])
        image_row = int(shard["image_rows"][row])
        text, text_mask = padded_tokens(shard["text_tokens"], shard["text_offsets"], [row], self.text_length)
        sample = {"image": shard["image_tokens"][image_row].clone(),
                  "image_global": shard["image_global"][image_row].clone(), "text": text[0],
                  "text_mask": text_mask[0], "text_global": shard["text_global"][row].clone(),
                  "caption_id": int(shard["caption_ids"][row]), "image_id": int(shard["image_ids"][row]),
                  "truncated": bool(shard["truncated"][row])}
        if self.num_hard_negatives:
            k = self.num_hard_negatives
            neg, neg_mask = padded_tokens(shard["neg_tokens"], shard["neg_offsets"], range(row * k, (row + 1) * k),
                                          self.neg_text_length)
            sample.update(neg_text=neg, neg_text_mask=neg_mask, neg_text_global=shard["neg_global"][row].clone())
        return sample


def padded_tokens(flat: Tensor, offsets: Tensor, rows: Sequence[int], length: int) -> Tuple[Tensor, Tensor]:
    """Rows of a flat token store, zero-padded to `length`: (tokens [R, length, D], mask [R, length])."""
    tokens = torch.zeros(len(rows), length, flat.shape[-1], dtype=flat.dtype)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for out, row in enumerate(rows):
        start, stop = int(offsets[row]), int(offsets[row + 1])
        tokens[out, :stop - start] = flat[start:stop]
        mask[out, :stop - start] = True
    return tokens, mask


class FeatureDataModule(L.LightningDataModule):
    """Train/val `FeatureCaptions` of the configured splits, with CocoDataModule's DDP-sharded loaders.

    The trainer must be built with `use_distributed_sampler=False` (the loaders bring their own seeded
    samplers). The cache is found from the config and the backbone identity (`backbone_identity`), so a
    module whose frozen CLIP differs from the cached one fails with a message naming the job to run.

    Args:
        cfg: the whole experiment config (`data`, `preprocess.shard_size`, `seed`).
        backbone: `backbone_identity(model_name, clip)` of the module that will read the features.
    """

    def __init__(self, cfg, backbone: Dict[str, Any]):
        super().__init__()
        self.cfg = cfg
        self.backbone = backbone
        self.train_dataset: Optional[FeatureCaptions] = None
        self.val_dataset: Optional[FeatureCaptions] = None

    @classmethod
    def for_module(cls, cfg, module) -> "FeatureDataModule":
        """The DataModule of a frozen-backbone module (`module.model_name`, `module.clip`)."""
        return cls(cfg, backbone_identity(module.model_name, module.clip))

    def _split(self, name: str) -> Optional[FeatureSplit]:
        return next((s for s in feature_splits(self.cfg) if s.split == name), None)

    def _open(self, split: FeatureSplit) -> FeatureShards:
        return open_feature_cache(split_cache_dir(self.cfg, split, self.backbone))

    def prepare_data(self) -> None:
        """Rank 0 checks that every split's cache is finished (the job is offline; nothing is built here)."""
        for split in feature_splits(self.cfg):
            self._open(split)

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.train_dataset is None:
            self.train_dataset = FeatureCaptions(self._open(self._split("train")))
        val = self._split("val")
        if stage in ("fit", "validate") and self.val_dataset is None and val is not None:
            self.val_dataset = FeatureCaptions(self._open(val))

    def train_dataloader(self) -> DataLoader:
        """Shuffled, sharded over ranks, full batches only (as CocoDataModule)."""
        if self.train_dataset is None:
            raise RuntimeError("the train split is not built; call setup('fit') first")
        world_size, rank = self._world_size_and_rank()
        batch_size = per_device_batch_size(self.cfg.data)
        check_enough_samples(len(self.train_dataset), batch_size, world_size)
        return build_dataloader(self.train_dataset, batch_size=batch_size,
                                num_workers=self.cfg.data.num_workers, world_size=world_size, rank=rank, train=True,
                                seed=self.cfg.seed,
                                position=trainer_epoch_position(self.trainer) if self.trainer else None)

    def val_dataloader(self) -> DataLoader:
        if self.val_dataset is None:
            raise RuntimeError("the val split is not built; call setup('fit') or setup('validate') first")
        world_size, rank = self._world_size_and_rank()
        data = self.cfg.data
        return build_dataloader(self.val_dataset, batch_size=per_device_batch_size(data, validation=True),
                                num_workers=data.num_workers, world_size=world_size, rank=rank, train=False)

    def _world_size_and_rank(self) -> Tuple[int, int]:
        if self.trainer is None:
            return 1, 0
        return self.trainer.world_size, self.trainer.global_rank


if __name__ == "__main__":
    main()

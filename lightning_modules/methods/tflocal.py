"""TFLocal / TFGlobal: a small transformer aligner on a frozen CLIP ("Role of Inference";
docs/methods.md#tflocal-and-tfglobal).

The CLIP backbone is frozen (no gradient, eval mode, outside the optimizer); its features are normally read
from the offline cache (datamodules/features.py) so that training touches no image. The aligner scores one
(image, caption) pair per forward:

    [CLS; text tokens; image tokens]  ->  LayerNorm + Linear(D -> d) + modality + position embeddings
                                      ->  pre-LN transformer (d, `aligner_layers`, `aligner_heads`, FFN 4d)
                                      ->  MLP(CLS) -> scalar score (a logit)

TFLocal reads the projected text tokens (SOT .. EOS, padding masked) and image tokens (global + P patches);
TFGlobal reads only the two global embeddings (one token each), the baseline showing that capacity alone
does not help. Every pair of the B x B batch grid is scored (B^2 forwards; `method.aligner_negatives` = n
scores only each anchor's n hardest in-batch partners by frozen cosine) plus each image against its own hard
negative captions; the loss is InfoNCE over the grid (hard negatives as extra image-to-text columns, as
NegCLIP) or, with `method.aligner_loss=itm`, a class-balanced binary image-text matching loss.

The aligner itself (`TokenAligner`, a plain nn.Module), its export (`export/aligner.pt` + `export/aligner.json`,
beside the backbone's `open_clip.pt`) and `AlignerScorer`, which scores benchmark candidates with it, are in
evaluation/aligner.py: scoring an export needs no training code.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor

from modeling.encoders import CLIPEncoders
from datamodules.features import backbone_fingerprint, frozen_image_features, frozen_text_features, length_mask
from evaluation.aligner import AlignerScorer, export_aligner
from lightning_modules.base import HOST_LENGTHS, CompositionalCLIPModule, Terms
from modeling.aligner import IMAGE, TEXT, TokenAligner

log = logging.getLogger(__name__)

# ----- losses (plain torch) -----------------------------------------------------------------------------------
def aligner_infonce(grid: Tensor, hard: Optional[Tensor] = None) -> Tensor:
    """1/2 [CE(image -> [grid row; its hard negatives]) + CE(text -> grid column)], labels on the diagonal.

    `grid` [B, B] holds score(image i, text j) (-inf for unscored pairs); `hard` [B, K] score(image i, its
    k-th negative caption). Negative captions are never anchors (NegCLIP's convention).
    """
    labels = torch.arange(grid.shape[0], device=grid.device)
    image_to_text = grid if hard is None else torch.cat([grid, hard], dim=1)
    return 0.5 * (F.cross_entropy(image_to_text.float(), labels) + F.cross_entropy(grid.T.float(), labels))


def aligner_itm(grid: Tensor, hard: Optional[Tensor] = None) -> Tensor:
    """Binary matching: 1/2 [mean BCE(positives, 1) + mean BCE(scored negatives, 0)] [ours: class-balanced,
    since a B x B grid has B positives for B^2 - B negatives]; the positive term alone without any negative.

    The scored negatives are weighted rather than selected, so that no count is read back from the device. In
    float32 at least (float64 stays float64)."""
    dtype = torch.promote_types(grid.dtype, torch.float32)
    diagonal = torch.eye(grid.shape[0], dtype=torch.bool, device=grid.device)
    positives = grid.diagonal().to(dtype)
    scored = ~diagonal & torch.isfinite(grid)
    negatives = grid.to(dtype).masked_fill(~scored, 0.0).flatten()  # unscored -inf would make the BCE NaN
    weights = scored.flatten().to(dtype)
    if hard is not None:
        negatives = torch.cat([negatives, hard.flatten().to(dtype)])
        weights = torch.cat([weights, torch.ones_like(negatives[: hard.numel()])])
    positive_loss = F.binary_cross_entropy_with_logits(positives, torch.ones_like(positives))
    per_negative = F.binary_cross_entropy_with_logits(negatives, torch.zeros_like(negatives), reduction="none")
    count = weights.sum()
    negative_loss = (per_negative * weights).sum() / count.clamp(min=1)
    return torch.where(count > 0, 0.5 * (positive_loss + negative_loss), positive_loss)


ALIGNER_LOSSES: Dict[str, Tuple[str, Callable[..., Tensor]]] = {
    # The contrastive term keeps CLIP-FT's name, so the default checkpoint monitor (val/itc_loss) applies.
    "infonce": ("itc_loss", aligner_infonce),
    "itm": ("itm_loss", aligner_itm),
}


def hardest_pairs(image_global: Tensor, text_global: Tensor, count: int) -> Tensor:
    """bool [B, B]: the diagonal, each image's `count` most similar other texts and each text's `count` most
    similar other images by frozen global cosine (the pairs scored with `method.aligner_negatives`)."""
    cosine = F.normalize(image_global.float(), dim=-1) @ F.normalize(text_global.float(), dim=-1).T
    diagonal = torch.eye(cosine.shape[0], dtype=torch.bool, device=cosine.device)
    others = cosine.masked_fill(diagonal, float("-inf"))
    count = min(count, cosine.shape[0] - 1)
    chosen = diagonal.clone()
    chosen.scatter_(1, others.topk(count, dim=1).indices, True)
    chosen.scatter_(0, others.topk(count, dim=0).indices, True)
    return chosen


def alignment_report(grid: Tensor, hard: Optional[Tensor]) -> Terms:
    """Batch accuracies: image -> text (with hard negatives), text -> image, positive above its hard negatives."""
    grid = grid.detach()
    labels = torch.arange(grid.shape[0], device=grid.device)
    image_to_text = grid if hard is None else torch.cat([grid, hard.detach()], dim=1)
    report = {"align/i2t_accuracy": (image_to_text.argmax(dim=1) == labels).float().mean(),
              "align/t2i_accuracy": (grid.argmax(dim=0) == labels).float().mean()}
    if hard is not None:
        report["align/hard_accuracy"] = (grid.diagonal() > hard.detach().max(dim=1).values).float().mean()
    return report


# ----- batches: cached features or pixels ---------------------------------------------------------------------
@dataclass
class AlignerInputs:
    """Token sets of a batch as the aligner reads them (TFGlobal: one token each)."""

    text: Tensor  # [B, L, D]
    text_mask: Tensor  # [B, L] bool, True = real token
    image: Tensor  # [B, I, D]
    image_global: Tensor  # [B, D], frozen, for choosing in-batch negatives
    text_global: Tensor  # [B, D]
    neg_text: Optional[Tensor] = None  # [B, K, L', D]
    neg_text_mask: Optional[Tensor] = None  # [B, K, L']


def is_feature_batch(batch: dict) -> bool:
    """Whether a batch comes from the feature cache (FeatureCaptions) rather than from images."""
    return "text_mask" in batch


def padded_length(mask: Tensor) -> int:
    """Positions up to the longest row's last real token (at least 1) of a token mask [..., L]."""
    return max(1, int(mask.sum(dim=-1).max()))


def trim_padding(tokens: Tensor, mask: Tensor, length: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Drop positions padded in every row (the cache pads to the split's longest caption): those after `length`,
    measured on the host before the batch moved, or here (a read of a device value) when None."""
    length = padded_length(mask) if length is None else length
    return tokens[..., :length, :], mask[..., :length]


def feature_lengths(batch: dict) -> Dict[str, int]:
    """`padded_length` of the token sets of a host feature batch (`text`, `neg_text`), by entry."""
    return {key: padded_length(batch[f"{key}_mask"]) for key in ("text", "neg_text") if f"{key}_mask" in batch}


def aligner_inputs(features: dict, kind: str, lengths: Optional[Dict[str, int]] = None) -> AlignerInputs:
    """TFLocal reads token sets, TFGlobal the two global embeddings, from a feature batch (cache layout)."""
    negatives = "neg_text" in features
    if kind == "global":
        ones = torch.ones(features["text_global"].shape[0], 1, dtype=torch.bool, device=features["text"].device)
        neg = features["neg_text_global"].unsqueeze(-2) if negatives else None
        return AlignerInputs(features["text_global"][:, None], ones, features["image_global"][:, None],
                             features["image_global"], features["text_global"], neg,
                             ones[:, None].expand(*neg.shape[:2], 1) if negatives else None)
    lengths = lengths or {}
    text, text_mask = trim_padding(features["text"], features["text_mask"], lengths.get("text"))
    neg, neg_mask = (trim_padding(features["neg_text"], features["neg_text_mask"], lengths.get("neg_text"))
                     if negatives else (None, None))
    return AlignerInputs(text, text_mask, features["image"], features["image_global"], features["text_global"],
                         neg, neg_mask)


# ----- the Lightning modules ----------------------------------------------------------------------------------
class AlignerModule(CompositionalCLIPModule):
    """Frozen CLIP + `TokenAligner`; subclasses set `kind` ("local": token sets, "global": embeddings)."""

    kind = "local"
    # fit builds datamodules.features.FeatureDataModule for such a module when data.features_cache is set
    # (otherwise batches of images are encoded on the fly, under no_grad).
    reads_cached_features = True
    # the aligners read no preprocessing-cache mask
    required_masks: Tuple[str, ...] = ()
    # method.hard_negatives.captions: the aligner loss scores each sample's hard captions (from the batch)
    uses_hard_negatives = True
    # the backbone stays frozen: fit refuses LoRA adapters (model.lora) for it
    trains_backbone = False

    def __init__(self, cfg: DictConfig):
        super().__init__(cfg)
        # docs/methods.md#tflocal-and-tfglobal: the backbone is frozen (no gradient, eval mode); base.param_groups
        # then gives the optimizer only the aligner (the empty backbone groups are dropped there).
        self.encoders.requires_grad_(False)
        self.encoders.eval()
        m = cfg.method
        self.aligner = TokenAligner(self.clip.visual.output_dim, m.aligner_width, m.aligner_layers, m.aligner_heads,
                                    **self._positions(), score_bias=m.aligner_loss == "itm")
        # Score only the n hardest in-batch partners per anchor (null: every pair).
        self.in_batch_negatives = m.aligner_negatives
        self.term_name, self.objective = ALIGNER_LOSSES[m.aligner_loss]

    def _positions(self) -> Dict[str, int]:
        if self.kind == "global":
            return {"text_positions": 1, "image_positions": 1}
        rows, columns = self.encoders.grid_size
        return {"text_positions": self.clip.context_length, "image_positions": 1 + rows * columns}

    def train(self, mode: bool = True) -> "AlignerModule":
        """Lightning calls `.train()` at every epoch start and after validation: the backbone stays in eval."""
        super().train(mode)
        self.encoders.eval()
        return self

    def host_work(self, batch: dict) -> dict:
        """Also the token sets' lengths of a feature batch (under `HOST_LENGTHS`, beside a pixel batch's caption
        lengths)."""
        work = super().host_work(batch)
        if is_feature_batch(batch):
            work[HOST_LENGTHS] = feature_lengths(batch)
        return work

    @torch.no_grad()
    def encode_batch(self, batch: dict) -> dict:
        """A pixel / token-id batch (CocoDataModule) as the feature cache would give it (float32, unpadded)."""
        image, image_global = frozen_image_features(self.encoders, batch["image"])
        features = {"image": image, "image_global": image_global,
                    **_text_entries(self.encoders, batch["text"], "text", self.trim_length(batch, "text"))}
        if "neg_text" in batch:
            ids = batch["neg_text"]
            negatives = _text_entries(self.encoders, ids.flatten(0, 1), "neg_text", self.trim_length(batch, "neg_text"))
            features.update({key: value.unflatten(0, ids.shape[:2]) for key, value in negatives.items()})
        return features

    def compute_terms(self, batch: dict) -> Tuple[Terms, Terms]:
        features = batch if is_feature_batch(batch) else self.encode_batch(batch)
        # Token sets trimmed at the lengths measured on the host: a feature batch's, or the captions' (which are the
        # lengths of the token sets encoded from them, trimmed after the last EOS).
        inputs = aligner_inputs(features, self.kind, batch.get(HOST_LENGTHS))
        grid, hard = self.score_batch(inputs)
        return {self.term_name: self.objective(grid, hard)}, alignment_report(grid, hard)

    def score_batch(self, inputs: AlignerInputs) -> Tuple[Tensor, Optional[Tensor]]:
        """(grid [B, B] of score(image i, text j), -inf where unscored; hard [B, K] or None)."""
        text = self.aligner.embed(inputs.text, TEXT)
        image = self.aligner.embed(inputs.image, IMAGE)
        size = image.shape[0]
        if self.in_batch_negatives is None:  # every pair, in the row-major order of nonzero(), without its sync
            every = torch.arange(size, device=image.device)
            image_index, text_index = every.repeat_interleave(size), every.repeat(size)
        else:  # how many pairs the union holds is read back from the device
            chosen = hardest_pairs(inputs.image_global, inputs.text_global, self.in_batch_negatives)
            image_index, text_index = chosen.nonzero(as_tuple=True)
        scores = self.aligner.score_pairs(text, inputs.text_mask, image, text_index, image_index)
        grid = torch.full((size, size), float("-inf"), device=scores.device).index_put((image_index, text_index),
                                                                                        scores)
        if inputs.neg_text is None:
            return grid, None
        count = inputs.neg_text.shape[1]
        negatives = self.aligner.embed(inputs.neg_text.flatten(0, 1), TEXT)
        own_image = torch.arange(size, device=image.device).repeat_interleave(count)
        hard = self.aligner.score_pairs(negatives, inputs.neg_text_mask.flatten(0, 1), image,
                                        torch.arange(size * count, device=image.device), own_image)
        return grid, hard.view(size, count)

    def on_fit_end(self) -> None:
        """Write the aligner beside the backbone export (`<run>/export/`, where ExportCallback writes)."""
        if self.trainer.is_global_zero:
            export_dir = Path(self.trainer.default_root_dir) / "export"
            export_aligner(self.aligner, self.kind, self.backbone_metadata(), export_dir,
                           {"method": self.cfg.method.name, "global_step": self.trainer.global_step,
                            "rerank_k": self.cfg.method.rerank_k})

    def benchmark_scorer(self, device: str, precision: str, batch_size: int) -> "AlignerScorer":
        """What benchmarks score during training: the aligner (re-ranking as configured), not the frozen cosine."""
        return AlignerScorer(self.clip, self.aligner, self.kind, self.tokenizer, self.preprocess_val,
                             device=device, precision=precision, batch_size=batch_size,
                             rerank_k=self.cfg.method.rerank_k, metadata={"model": self.model_name, "kind": self.kind})

    def backbone_metadata(self) -> dict:
        model = self.cfg.model
        return {"model": self.model_name, "pretrained": model.pretrained, "config_dir": model.config_dir,
                "weights_sha256": backbone_fingerprint(self.clip)}


class TFLocal(AlignerModule):
    """The aligner over [CLS; text tokens; image tokens] (docs/methods.md#tflocal-and-tfglobal)."""

    kind = "local"


class TFGlobal(AlignerModule):
    """The same aligner over [CLS; text embedding; image embedding] (docs/methods.md#tflocal-and-tfglobal)."""

    kind = "global"


def _text_entries(encoders: CLIPEncoders, ids: Tensor, prefix: str, trim: Union[bool, int] = True
                  ) -> Dict[str, Tensor]:
    tokens, lengths, pooled = frozen_text_features(encoders, ids, trim)
    return {prefix: tokens, f"{prefix}_mask": length_mask(lengths, tokens.shape[1]), f"{prefix}_global": pooled}

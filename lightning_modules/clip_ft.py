"""CLIP-FT: contrastive fine-tuning of CLIP, with optional NegCLIP hard-negative captions."""
from __future__ import annotations

from typing import Tuple

import torch.nn.functional as F
from omegaconf import DictConfig

from lightning_modules.base import CompositionalCLIPModule, Terms
from lightning_modules.losses import ClipLoss


class ClipFineTune(CompositionalCLIPModule):
    """`L_itc` over the global batch (METHODS.md, common contrastive loss).

    With `method.hard_negatives`, each sample's `neg_text` captions [B, K, L] are encoded and appended as
    extra image-to-text columns (NegCLIP); they are never anchors of the text-to-image direction.
    """

    def __init__(self, cfg: DictConfig):
        super().__init__(cfg)
        self.itc = ClipLoss(local_loss=True, gather_with_grad=True)

    def compute_terms(self, batch: dict) -> Tuple[Terms, Terms]:
        image = F.normalize(self.encoders.encode_image(batch["image"]).pooled, dim=-1)
        text = F.normalize(self.encoders.encode_text(batch["text"], trim=True).pooled, dim=-1)
        # Hard negatives shape the training objective; validation scores the plain contrastive loss.
        use_negatives = self.cfg.method.hard_negatives and self.training
        negatives = self._encode_negatives(batch) if use_negatives else None
        loss = self.itc(image, text, self.clip.logit_scale.exp(), negatives)
        return {"itc_loss": loss}, {}

    def _encode_negatives(self, batch: dict):
        if "neg_text" not in batch:
            raise KeyError("method.hard_negatives=true but the batch has no neg_text: set "
                           "data.num_hard_negatives > 0 and use annotations with neg_captions")
        neg_ids = batch["neg_text"]
        pooled = self.encoders.encode_text(neg_ids.flatten(0, 1), trim=True).pooled
        return F.normalize(pooled, dim=-1).view(*neg_ids.shape[:2], -1)

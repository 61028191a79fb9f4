"""CLIP-FT: contrastive fine-tuning of CLIP; NegCLIP with its hard-negative captions and images.

NegCLIP as its training code trains (vinid/neg_clip: `src/training/data.py` CsvDataset, `src/training/train.py`
train_one_epoch, `src/open_clip/loss.py` ClipLoss) [code]: a batch of B rows becomes 2B images
`[I; I_n]` (the rows' images, then their `neg_image` neighbours) and 4B texts `[T; T_n; H; H_n]` (captions,
the neighbours' own captions, hard captions, the neighbours' own hard captions). Image-to-text scores the 2B
images against all 4B texts; text-to-image scores only the 2B captions `[T; T_n]` against the 2B images
(`logits_per_text[:len(logits_per_image)]`); labels arange(2B), the mean of both cross-entropies. That is
`ClipLoss(images=[I; I_n], texts=[T; T_n], negatives=[H; H_n])` here. Under DDP the same loss over the global
batch [ours: the official code trains on one GPU; its gathered labels would not point at the right columns].
"""
from __future__ import annotations

from typing import Tuple, Union

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor

from lightning_modules.base import CompositionalCLIPModule, Terms, required_entry
from modeling.losses import ClipLoss


class ClipFineTune(CompositionalCLIPModule):
    """`L_itc` over the global batch (docs/methods.md#clip-ft-and-negclip).

    With `method.hard_negatives.captions`, each sample's `neg_text` captions [B, K, L] are encoded and appended as
    extra image-to-text columns (NegCLIP); they are never anchors of the text-to-image direction. With
    `method.hard_negatives.images`, each sample's neighbour image and its own caption join as anchors (and its
    own `neg_image_neg_text` as columns). Both shape the training objective only: validation scores the plain
    contrastive loss of the samples themselves.
    """

    # method.hard_negatives.captions / .images are accepted only by methods that use them
    # (fit.check_inputs); the hard captions are encoded by the base's shared `encode_hard_negatives`.
    uses_hard_negatives = True
    uses_hard_negative_images = True
    # The preprocessing cache's masks read from every batch; fit refuses to start without data.masks=true when
    # a method needs any (fit.mask_problems). Plain contrastive fine-tuning reads none.
    required_masks: Tuple[str, ...] = ()

    def __init__(self, cfg: DictConfig):
        super().__init__(cfg)
        self.itc = ClipLoss(local_loss=True, gather_with_grad=True)

    def compute_terms(self, batch: dict) -> Tuple[Terms, Terms]:
        image = self._image_features(batch["image"])
        text = self._text_features(batch["text"], self.trim_length(batch, "text"))
        return {"itc_loss": self._contrastive_loss(batch, image, text)}, {}

    def _image_features(self, images: Tensor) -> Tensor:
        return F.normalize(self.encoders.encode_image(images).pooled, dim=-1)

    def _text_features(self, ids: Tensor, trim: Union[bool, int] = True) -> Tensor:
        return F.normalize(self.encoders.encode_text(ids, trim=trim).pooled, dim=-1)

    def _contrastive_loss(self, batch: dict, image: Tensor, text: Tensor) -> Tensor:
        """L_itc of the samples' features `image`, `text` [B, D]; in training with NegCLIP's hard negatives."""
        neighbours = self.training and self.cfg.method.hard_negatives.images
        if neighbours:
            image = torch.cat([image, self._image_features(required_entry(batch, "neg_image"))])
            text = torch.cat([text, self._text_features(batch["neg_image_text"],
                                                        self.trim_length(batch, "neg_image_text"))])
        negatives = self.encode_hard_negatives(batch, neighbours) if self.trains_on_hard_negatives else None
        return self.itc(image, text, self.clip.logit_scale.exp(), negatives)

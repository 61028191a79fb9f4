"""CLIP-CAE: contrastive fine-tuning plus composition attribution enhancement (EMNLP 2024; METHODS.md).

`L = L_itc + lambda * mean_valid max(0, A_obj - A_comp + eps)`: for each positive pair (image b, caption b)
a per-token attribution `a` of the similarity to the caption's tokens is computed (attention, gradcam,
perturbation, gradient or grad_eclip; `method.attribution`), averaged over the object tokens (A_obj) and
over the relation and attribute tokens (A_comp) given by the preprocessing cache's `obj_mask` / `comp_mask`.
Captions lacking either group do not enter the term. The attribution of the training forward is the one
penalised: attention is read from the same text forward as the contrastive loss, and the gradient-based
methods differentiate it with `create_graph=True` (double backward).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Tuple

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor

from lightning_modules.attribution import (TextAttributionInputs, attribution_options, group_means,
                                           text_attribution, word_end_table)
from lightning_modules.base import Terms
from lightning_modules.clip_ft import ClipFineTune
from lightning_modules.losses import cae_attribution_loss

# Methods that differentiate the text forward: double backward needs the explicit attention (PyTorch's fused
# attention kernels have no second derivative), which also gives the probabilities and traces that the
# attention, gradcam and grad_eclip methods read.
GRADIENT_BASED = ("gradcam", "gradient", "grad_eclip")
EXPLICIT_ATTENTION = ("attention",) + GRADIENT_BASED


class ClipCAE(ClipFineTune):
    """CLIP-FT (with optional NegCLIP negatives) plus CAE's attribution hinge; needs `data.masks=true`."""

    def __init__(self, cfg: DictConfig):
        super().__init__(cfg)
        self.attribution = cfg.method.attribution.name
        self.attribution_options = attribution_options(cfg.method.attribution)
        self.register_buffer("word_ends", word_end_table(self.tokenizer, self.clip.vocab_size), persistent=False)

    def compute_terms(self, batch: dict) -> Tuple[Terms, Terms]:
        _check_masks(batch)
        # Validation runs under no_grad; gradient-based attributions still need a graph to differentiate.
        with torch.enable_grad() if self.attribution in GRADIENT_BASED else nullcontext():
            image = F.normalize(self.encoders.encode_image(batch["image"]).pooled, dim=-1)
            text_features = self.encoders.encode_text(batch["text"], attn=self.attribution in EXPLICIT_ATTENTION,
                                                      trim=True)
            attribution = self._attribution(batch["text"], image, text_features)
        text = F.normalize(text_features.pooled, dim=-1)
        negatives = self._encode_negatives(batch) if self.cfg.method.hard_negatives and self.training else None
        itc = self.itc(image, text, self.clip.logit_scale.exp(), negatives)
        attr_obj, has_obj = group_means(attribution, batch["obj_mask"])
        attr_comp, has_comp = group_means(attribution, batch["comp_mask"])
        valid = has_obj & has_comp
        attr_loss = cae_attribution_loss(attr_obj, attr_comp, valid, self.cfg.method.attr_margin)
        terms = {"itc_loss": itc, "attr_loss": self.cfg.method.attr_weight * attr_loss}
        return terms, _attribution_report(attr_obj, attr_comp, valid)

    def _attribution(self, ids: Tensor, image: Tensor, text_features) -> Tensor:
        ids = ids[:, : text_features.tokens.shape[1]]  # the trimmed length of the text forward
        inputs = TextAttributionInputs(self.encoders, ids, image, text_features, self.word_ends)
        return text_attribution(self.attribution, inputs, self.attribution_options, create_graph=self.training)


def _check_masks(batch: dict) -> None:
    if "obj_mask" not in batch or "comp_mask" not in batch:
        raise KeyError("CLIP-CAE needs obj_mask and comp_mask in every batch: set data.masks=true and run "
                       "python -m datamodules.preprocess --config ... first")


def _attribution_report(attr_obj: Tensor, attr_comp: Tensor, valid: Tensor) -> Terms:
    """Mean A_obj, A_comp and gap (A_comp - A_obj; positive = composition words win) over valid captions."""
    weights = valid.to(attr_obj.dtype)
    count = weights.sum().clamp(min=1)
    obj = (attr_obj.detach() * weights).sum() / count
    comp = (attr_comp.detach() * weights).sum() / count
    return {"attr/obj": obj, "attr/comp": comp, "attr/gap": comp - obj, "attr/valid_fraction": weights.mean()}

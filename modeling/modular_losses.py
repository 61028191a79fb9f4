"""SmartCLIP's modular contrastive losses and its straight-through mask, plain torch (no Lightning).

SmartCLIP (CVPR 2025; docs/methods.md#modular-contrastive-loss) scores image a against caption b only on the
embedding dimensions that caption b's mask m_b keeps: `S[a, b] = tau <norm(x_a * m_b), t_b>`, with x the
unnormalised image embeddings, t the L2-normalised text embeddings and a fixed temperature tau (100; CLIP's
logit_scale is unused).

- `sidm_i = CE_j(S[i, j], i)`: image i against every caption j, each caption with its own mask;
- `dism_i = CE_k(S[k, i], i)`: caption i's mask applied to every image k.

Both are cross-entropies over the same matrix S, by rows and by columns. With NegCLIP's hard captions
(SmartCLIP + NegCLIP [ours]; SmartCLIP has none) each hard caption n is one more column of sidm's rows, scored
like every caption under its own mask m_n (`S[i, n] = tau <norm(x_i * m_n), t_n>`); it is no anchor of dism.

Under data parallelism the image embeddings, text embeddings and masks (and hard captions with their masks)
of every rank are gathered with gradient and each rank scores only its own rows of sidm and its own columns
of dism against the whole global batch (open_clip's local-loss semantics, `modeling.losses`):
averaging the ranks' gradients (DDP) then gives exactly the single-process big-batch gradient.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modeling.losses import check_equal_batches, gather_features, world_info

# F.normalize's floor on the norm: an all-zero masked image scores 0 instead of NaN.
NORM_EPS = 1e-12


def straight_through_mask(logits: Tensor, hard: bool = True) -> Tensor:
    """The mask `m` from mask logits [B, D]: sigmoid, then (hard) a 0.5 threshold with straight-through gradient.

    The hard mask is binary in the forward pass and has the sigmoid's gradient in the backward pass
    (`(soft >= 0.5) - soft.detach() + soft`, docs/methods.md#mask-network). With `hard=False` the sigmoid itself
    is the mask.
    In fp32 under autocast too: the straight-through gradient is the sigmoid's, small where |logits| is large.
    """
    soft = torch.sigmoid(logits.float())
    if not hard:
        return soft
    return (soft >= 0.5).to(soft.dtype) - soft.detach() + soft


def masked_logits(images: Tensor, masks: Tensor, texts: Tensor, temperature: float) -> Tensor:
    """`S[a, b] = temperature * <norm(x_a * m_b), t_b>` for images [A, D] and captions' masks, texts [B, D].

    Written as two matrix products, never the [A, B, D] tensor of masked images:
    `<x_a * m_b, t_b> = x_a . (m_b * t_b)` and `||x_a * m_b||^2 = x_a^2 . m_b^2`. The squared norm is floored
    before the square root (F.normalize's `max(||v||, eps)`) so that an all-zero mask has a finite gradient.
    """
    similarity = images @ (masks * texts).T
    squared_norms = images.square() @ masks.square().T
    return temperature * similarity / squared_norms.clamp(min=NORM_EPS ** 2).sqrt()


class ModularContrastiveLoss(nn.Module):
    """SmartCLIP's `(sidm, dism)` over the global batch, in fp32 even under bf16 autocast.

    Args:
        temperature: the fixed logit scale (100 in SmartCLIP).
    """

    def __init__(self, temperature: float = 100.0):
        super().__init__()
        self.temperature = temperature

    def forward(self, images: Tensor, texts: Tensor, masks: Tensor, neg_texts: Optional[Tensor] = None,
                neg_masks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Return `(sidm, dism)`, each the mean over this rank's samples.

        Args:
            images: [B, D] unnormalised image embeddings x.
            texts: [B, D] L2-normalised text embeddings t.
            masks: [B, D] each caption's mask m over the embedding dimensions.
            neg_texts: optional [B, K, D] L2-normalised hard captions (NegCLIP), extra columns of sidm only.
            neg_masks: [B, K, D] each hard caption's own mask (given with `neg_texts`).
        """
        if (neg_texts is None) != (neg_masks is None):
            raise ValueError("hard captions need their own masks: give neg_texts and neg_masks together")
        with torch.autocast(device_type=images.device.type, enabled=False):
            negatives = None if neg_texts is None else (neg_texts.float(), neg_masks.float())
            return self._losses(images.float(), texts.float(), masks.float(), negatives)

    def _losses(self, images: Tensor, texts: Tensor, masks: Tensor,
                negatives: Optional[Tuple[Tensor, Tensor]]) -> Tuple[Tensor, Tensor]:
        rank, world_size = world_info()
        if world_size > 1:
            check_equal_batches(images.shape[0], world_size, images.device)
        gather = lambda x: gather_features(x, rank, world_size, with_grad=True)  # noqa: E731
        all_images, all_texts, all_masks = gather(images), gather(texts), gather(masks)
        labels = torch.arange(images.shape[0], device=images.device) + images.shape[0] * rank
        # sidm: this rank's images (rows) against every caption of the global batch under its own mask, then
        # (with NegCLIP) every hard caption under its own mask; the labels point into the first columns.
        column_texts, column_masks = all_texts, all_masks
        if negatives is not None:
            neg_texts, neg_masks = (gather(t).flatten(0, 1) for t in negatives)
            column_texts, column_masks = torch.cat([all_texts, neg_texts]), torch.cat([all_masks, neg_masks])
        sidm = F.cross_entropy(masked_logits(images, column_masks, column_texts, self.temperature), labels)
        # dism: this rank's captions (columns), their masks applied to every image of the global batch.
        per_caption = masked_logits(all_images, masks, texts, self.temperature).T
        dism = F.cross_entropy(per_caption, labels)
        return sidm, dism


def mask_sparsity(masks: Tensor) -> Tensor:
    """SmartCLIP's sparsity term: mean |m| over samples and dimensions (fp32)."""
    return masks.float().abs().mean()


def active_dimensions(masks: Tensor) -> Tensor:
    """Number of kept dimensions per sample [B]: m >= 0.5 (exactly the hard mask's ones)."""
    return (masks.detach() >= 0.5).sum(dim=-1)

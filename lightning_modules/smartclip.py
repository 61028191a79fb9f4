"""SmartCLIP: text-conditioned binary masks over the image embedding's dimensions (CVPR 2025; METHODS.md).

A caption rarely describes everything in its image, so SmartCLIP aligns each caption only with the embedding
dimensions it selects: a mask network reads the caption's per-token features and outputs a mask m over the D
joint dimensions; image embeddings are compared with a caption after masking by that caption's mask
(`lightning_modules.modular_losses`). The objective is

    10 (sidm + dism) + 2 mean|m|          (fixed temperature 100; CLIP's logit_scale is unused)

The mask network only trains itself: it reads the text features detached, so no gradient of the mask reaches
the text encoder. Inference is plain unmasked CLIP: the export (`self.clip`) leaves the mask network out.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from open_clip.transformer import ResidualAttentionBlock
from torch import Tensor, nn

from lightning_modules.base import CompositionalCLIPModule, Terms
from lightning_modules.losses import ClipLoss, gather_features, world_info
from lightning_modules.modular_losses import (ModularContrastiveLoss, active_dimensions, mask_sparsity,
                                              straight_through_mask)


def key_padding_attention_mask(valid: Tensor, heads: int) -> Tensor:
    """Additive mask [B * heads, L, L] of `nn.MultiheadAttention`: every query sees only valid keys [B, L].

    A float mask, because open_clip's block casts the mask to the activations' dtype (a bool mask would become
    0 / 1 and mask nothing). Position 0 (start of text) is always valid, so no row is fully masked.
    """
    batch, length = valid.shape
    blocked = torch.zeros(batch, 1, 1, length, device=valid.device)
    blocked = blocked.masked_fill(~valid[:, None, None, :], float("-inf"))
    return blocked.expand(batch, heads, length, length).reshape(batch * heads, length, length)


class MaskNetwork(nn.Module):
    """Per-token text features [B, L, width] -> mask logits [B, D] (METHODS.md, SmartCLIP).

    One CLIP residual attention block, then attention pooling (a Linear(width, 1) score per position, softmax
    over the caption's positions, weighted sum), then a Linear to D only when width != D (OpenAI CLIPs have
    width == D and the pooled vector is the logits).

    Args:
        width: text tower width. heads: attention heads of the block. embed_dim: D, the mask's size.
    """

    def __init__(self, width: int, heads: int, embed_dim: int):
        super().__init__()
        self.heads = heads
        self.block = ResidualAttentionBlock(width, heads, batch_first=True)
        # No bias: softmax over positions ignores a shift shared by all of them (the bias would get no gradient).
        self.pool_score = nn.Linear(width, 1, bias=False)
        self.to_logits = nn.Linear(width, embed_dim) if width != embed_dim else nn.Identity()

    def forward(self, tokens: Tensor, valid: Tensor) -> Tensor:
        """Mask logits from `tokens` [B, L, width]; `valid` [B, L] marks the caption's positions (up to EOS).

        The original runs CLIP's block without saying which attention mask; we attend bidirectionally over
        the caption's own positions (padding after EOS is neither attended to nor pooled).
        """
        x = self.block(tokens, attn_mask=key_padding_attention_mask(valid, self.heads))
        scores = self.pool_score(x).squeeze(-1).float().masked_fill(~valid, float("-inf"))
        weights = scores.softmax(dim=-1).to(x.dtype)
        pooled = (weights.unsqueeze(-1) * x).sum(dim=1)
        return self.to_logits(pooled)


def caption_positions(ids: Tensor) -> Tensor:
    """[B, L] True from the start token up to and including EOS (CLIP's EOS has the largest token id)."""
    eos = ids.argmax(dim=-1, keepdim=True)
    return torch.arange(ids.shape[1], device=ids.device) <= eos


class SmartCLIP(CompositionalCLIPModule):
    """SmartCLIP's modular contrastive fine-tuning (METHODS.md): `10 (sidm + dism) + 2 mean|m|`.

    Config: method.modular_weight (10), method.sparsity_weight (2), method.modular_temperature (100),
    method.hard_mask (straight-through binary mask, else the sigmoid); the mask network is the head group
    (optim.head_lr 1e-3, head_weight_decay 0, head_warmup_steps 0 in configs/smartclip.yaml).
    """

    def __init__(self, cfg: DictConfig):
        super().__init__(cfg)
        # The temperature is fixed (METHODS.md): logit_scale takes no part and stays out of the optimizer.
        self.clip.logit_scale.requires_grad_(False)
        text = self.clip.transformer
        self.mask_net = MaskNetwork(self.encoders.text_width, text.resblocks[0].attn.num_heads,
                                    self.clip.visual.output_dim)
        self.modular = ModularContrastiveLoss(cfg.method.modular_temperature)
        self.unmasked_itc = ClipLoss(local_loss=True, gather_with_grad=False)

    def compute_terms(self, batch: dict) -> Tuple[Terms, Terms]:
        m = self.cfg.method
        images = self.encoders.encode_image(batch["image"]).pooled  # x: unnormalised (METHODS.md)
        pooled, hidden, valid = self.encode_text_with_hidden(batch["text"])
        texts = F.normalize(pooled, dim=-1)
        # Detached: the mask network learns from the losses without steering the text encoder.
        masks = straight_through_mask(self.mask_net(hidden.detach(), valid), hard=m.hard_mask)
        sidm, dism = self.modular(images, texts, masks)
        terms = {"sidm_loss": m.modular_weight * sidm, "dism_loss": m.modular_weight * dism,
                 "sparsity_loss": m.sparsity_weight * mask_sparsity(masks)}
        report = mask_report(masks)
        if not self.training:  # what inference scores: plain cosine, no mask (the best-checkpoint metric)
            temperature = images.new_tensor(m.modular_temperature)
            report["unmasked_itc"] = self.unmasked_itc(F.normalize(images, dim=-1), texts, temperature)
        return terms, report

    def encode_text_with_hidden(self, ids: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """The trimmed text forward returning (pooled [B, D], hidden [B, L', width], valid [B, L']).

        `hidden` is the per-token output after ln_final and before the text projection, what the mask network
        reads (the tower is causal, so trimming after the batch's last EOS changes nothing).
        """
        features = self.encoders.encode_text(ids, trim=True)
        return features.pooled, features.hidden, caption_positions(ids[:, : features.hidden.shape[1]])


def mask_report(masks: Tensor) -> Terms:
    """Active mask dimensions per sample: mean, min and max over the global batch.

    Gathered (without gradient) so that every rank reports the same exact values: logging averages the ranks'
    scalars, which would turn per-rank minima and maxima into neither.
    """
    rank, world_size = world_info()
    active = active_dimensions(gather_features(masks.detach(), rank, world_size, with_grad=False)).float()
    return {"mask/active_mean": active.mean(), "mask/active_min": active.min(), "mask/active_max": active.max()}

"""SmartCLIP: text-conditioned binary masks over the image embedding's dimensions (CVPR 2025;
docs/methods.md#smartclip).

A caption rarely describes everything in its image, so SmartCLIP aligns each caption only with the embedding
dimensions it selects: a mask network reads the caption's per-token features and outputs a mask m over the D
joint dimensions; image embeddings are compared with a caption after masking by that caption's mask
(`modeling.modular_losses`). The objective is

    10 (sidm + dism) + 2 mean|m|          (fixed temperature 100; CLIP's logit_scale is frozen, unused)

The mask network only trains itself: it reads the text features detached, so no gradient of the mask reaches
the text encoder. Inference is plain unmasked CLIP: the export (`self.clip`) leaves the mask network out.

What is the official code's (SmartCLIP as carried by reyuyu/SAID; fixture `tests/data/parity/smartclip/`) and
what is ours:
- mask network [official]: one CLIP residual attention block (QuickGELU, CLIP's initialisation, width // 64
  heads) attending over **every** context position, padding after EOS included (no attention mask), then
  attention pooling over every position (`method.mask_positions: all`, the default);
- mask network [ours]: attending to and pooling over the caption's own positions SOT..EOS only
  (`method.mask_positions: caption`): padding then cannot change a caption's mask;
- an all-zero mask scores 0 (finite loss and gradients) [ours; the official divides by a zero norm: NaN];
- a Linear from the text width to D when the two differ [ours; the official needs width == D, true of the
  OpenAI CLIPs];
- long captions (the paper's recipe, `configs/smartclip_long.yaml`): Long-CLIP's 248-token text encoder
  (`model.context_length`, `modeling.long_context`) and a random sentence prefix of each ShareGPT4V
  caption (`data.train_caption_sentences: random_prefix`, `datamodules.coco`).

SmartCLIP + NegCLIP [ours; SmartCLIP has no hard negatives], `method.hard_negatives.captions: K` (off in the
paper configs): in training only, each sample's K hard captions go
through the same text forward and mask network as a caption and become extra columns of `sidm` (image i
against every caption, each under its own mask), as NegCLIP appends them to CLIP's image-to-text logits; they
are never anchors (`dism`, the caption's mask applied to every image, is unchanged) and the sparsity term and
mask report stay over the samples' own masks. Why the masked term: SmartCLIP trains no unmasked contrastive
term (the unmasked loss is only the validation metric `unmasked_itc`), so `sidm` is the method's own
image-to-text contrast; adding an unmasked NegCLIP term instead would add a second objective beside the
negatives. The mask network reads only the (detached) caption, never whether it is a negative.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from open_clip.transformer import QuickGELU, ResidualAttentionBlock
from torch import Tensor, nn

from lightning_modules.base import CompositionalCLIPModule, Terms
from modeling.losses import ClipLoss, gather_features, world_info
from modeling.modular_losses import (ModularContrastiveLoss, active_dimensions, mask_sparsity,
                                              straight_through_mask)

# OpenAI CLIP's head width: the original builds its mask network with `width // 64` heads.
HEAD_WIDTH = 64


def mask_network_heads(width: int) -> int:
    """Heads of the mask network's block: `width // 64` as the original (at least 1, for tiny test towers).

    For the OpenAI CLIPs this equals the text tower's own head count (8 at width 512, 12 at width 768).
    """
    return max(1, width // HEAD_WIDTH)


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
    """Per-token text features [B, L, width] -> mask logits [B, D] (docs/methods.md#mask-network).

    One CLIP residual attention block (QuickGELU), then attention pooling (a Linear(width, 1) score per
    position, softmax over positions, weighted sum), then a Linear to D only when width != D (OpenAI CLIPs have
    width == D and the pooled vector is the logits). Initialised as the original: CLIP's (open_clip's)
    transformer initialisation for one layer, the pool score with std width^-0.5; biases as PyTorch's defaults.

    The original's pool score has a bias (initialised to 0); a shift shared by all positions cancels in the
    softmax over positions, so ours has none (it would receive no gradient).

    Args:
        width: text tower width. heads: attention heads of the block (`mask_network_heads(width)` as the
            original). embed_dim: D, the mask's size.
    """

    def __init__(self, width: int, heads: int, embed_dim: int):
        super().__init__()
        self.heads = heads
        self.block = ResidualAttentionBlock(width, heads, act_layer=QuickGELU, batch_first=True)
        self.pool_score = nn.Linear(width, 1, bias=False)
        self.to_logits = nn.Linear(width, embed_dim) if width != embed_dim else nn.Identity()
        init_like_clip(self.block, self.pool_score, width)

    def forward(self, tokens: Tensor, valid: Optional[Tensor] = None) -> Tensor:
        """Mask logits from `tokens` [B, L, width].

        Args:
            tokens: per-token text features (after ln_final, before the text projection).
            valid: None to attend to and pool over every position, padding included [official]; or [B, L] True
                at the positions to use (the caption's SOT..EOS [ours]): other keys get no attention and no
                pooling weight.
        """
        attn_mask = key_padding_attention_mask(valid, self.heads) if valid is not None else None
        x = self.block(tokens, attn_mask=attn_mask)
        scores = self.pool_score(x).squeeze(-1).float()
        if valid is not None:
            scores = scores.masked_fill(~valid, float("-inf"))
        weights = scores.softmax(dim=-1).to(x.dtype)
        pooled = (weights.unsqueeze(-1) * x).sum(dim=1)
        return self.to_logits(pooled)


def init_like_clip(block: ResidualAttentionBlock, pool_score: nn.Linear, width: int, layers: int = 1) -> None:
    """The original's initialisation: open_clip's transformer init for a `layers`-deep transformer.

    in_proj std width^-0.5; out_proj and c_proj std width^-0.5 (2 layers)^-0.5; c_fc std (2 width)^-0.5; the
    pool score std width^-0.5.
    """
    attn_std = width ** -0.5
    proj_std = attn_std * (2 * layers) ** -0.5
    nn.init.normal_(block.attn.in_proj_weight, std=attn_std)
    nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
    nn.init.normal_(block.mlp.c_fc.weight, std=(2 * width) ** -0.5)
    nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
    nn.init.normal_(pool_score.weight, std=attn_std)


def caption_positions(ids: Tensor) -> Tensor:
    """[B, L] True from the start token up to and including EOS (CLIP's EOS has the largest token id)."""
    eos = ids.argmax(dim=-1, keepdim=True)
    return torch.arange(ids.shape[1], device=ids.device) <= eos


def mask_network_positions(ids: Tensor, mask_positions: str) -> Optional[Tensor]:
    """What the mask network attends to and pools over, for token ids [B, L]: None = every position, padding
    included (`mask_positions="all"`, the official code); else [B, L] True at SOT..EOS (`"caption"`, ours)."""
    return None if mask_positions == "all" else caption_positions(ids)


def modular_terms(images: Tensor, texts: Tensor, masks: Tensor, modular: ModularContrastiveLoss,
                  modular_weight: float, sparsity_weight: float,
                  negatives: Optional[Tuple[Tensor, Tensor]] = None) -> Terms:
    """SmartCLIP's weighted terms: `modular_weight (sidm + dism) + sparsity_weight mean|m|`.

    Args:
        images: [B, D] unnormalised image embeddings x. texts: [B, D] L2-normalised text embeddings.
        masks: [B, D] each caption's mask. modular: the loss at the fixed temperature.
        negatives: optional (hard captions [B, K, D] L2-normalised, their own masks [B, K, D]): extra columns
            of sidm [ours, NegCLIP]; the sparsity term is over `masks` only.
    """
    sidm, dism = modular(images, texts, masks, *(negatives or ()))
    return {"sidm_loss": modular_weight * sidm, "dism_loss": modular_weight * dism,
            "sparsity_loss": sparsity_weight * mask_sparsity(masks)}


class SmartCLIP(CompositionalCLIPModule):
    """SmartCLIP's modular contrastive fine-tuning (docs/methods.md#smartclip): `10 (sidm + dism) + 2 mean|m|`.

    Config: method.modular_weight (10), method.sparsity_weight (2), method.modular_temperature (100),
    method.hard_mask (straight-through binary mask, else the sigmoid), method.mask_positions ("all" [official]
    or "caption" [ours]), method.hard_negatives.captions (NegCLIP's hard captions as extra sidm columns
    [ours]); the mask network is the head group (optim.head_lr 1e-3, head_weight_decay 0, head_warmup_steps 0 in
    the SmartCLIP configs).
    """

    uses_hard_negatives = True
    # its masks are learnt over the embedding from the caption: no preprocessing-cache mask is read
    required_masks: Tuple[str, ...] = ()

    def __init__(self, cfg: DictConfig):
        super().__init__(cfg)
        # The temperature is fixed (docs/methods.md#modular-contrastive-loss): logit_scale takes no part and stays
        # out of the optimizer.
        self.clip.logit_scale.requires_grad_(False)
        width = self.encoders.text_width
        self.mask_net = MaskNetwork(width, mask_network_heads(width), self.clip.visual.output_dim)
        self.modular = ModularContrastiveLoss(cfg.method.modular_temperature)
        self.unmasked_itc = ClipLoss(local_loss=True, gather_with_grad=False)

    def compute_terms(self, batch: dict) -> Tuple[Terms, Terms]:
        m = self.cfg.method
        # x: unnormalised (docs/methods.md#modular-contrastive-loss)
        images = self.encoders.encode_image(batch["image"]).pooled
        pooled, hidden, valid = self.encode_text_with_hidden(batch["text"], self.trim_length(batch, "text"))
        texts = F.normalize(pooled, dim=-1)
        masks = self.caption_masks(hidden, valid)
        negatives = self.hard_negatives_with_masks(batch) if self.trains_on_hard_negatives else None
        terms = modular_terms(images, texts, masks, self.modular, m.modular_weight, m.sparsity_weight, negatives)
        report = mask_report(masks)
        if not self.training:  # what inference scores: plain cosine, no mask (the best-checkpoint metric)
            temperature = images.new_tensor(m.modular_temperature)
            report["unmasked_itc"] = self.unmasked_itc(F.normalize(images, dim=-1), texts, temperature)
        return terms, report

    def caption_masks(self, hidden: Tensor, valid: Optional[Tensor]) -> Tensor:
        """Each caption's mask [N, D] from its per-token features (`encode_text_with_hidden`)."""
        # Detached: the mask network learns from the losses without steering the text encoder.
        return straight_through_mask(self.mask_net(hidden.detach(), valid), hard=self.cfg.method.hard_mask)

    def hard_negatives_with_masks(self, batch: dict) -> Tuple[Tensor, Tensor]:
        """NegCLIP's hard captions (`neg_text` [B, K, L], via the base's `hard_negative_ids`) as L2-normalised
        embeddings [B, K, D] and their own masks [B, K, D]: the text forward and mask network of a caption,
        because each is scored under its own mask. [ours]"""
        ids = self.hard_negative_ids(batch)
        pooled, hidden, valid = self.encode_text_with_hidden(ids.flatten(0, 1), self.trim_length(batch, "neg_text"))
        shape = (*ids.shape[:2], -1)
        return F.normalize(pooled, dim=-1).view(shape), self.caption_masks(hidden, valid).view(shape)

    def encode_text_with_hidden(self, ids: Tensor, trim: Union[bool, int] = True
                                ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """The text forward returning (pooled [B, D], hidden [B, L', width], valid [B, L'] or None).

        `hidden` is the per-token output after ln_final and before the text projection, what the mask network
        reads. With `mask_positions: all` [official] the forward runs over the full context (L' = L, every
        padding position included) and `valid` is None. With `caption` [ours] only SOT..EOS matter, so the
        forward is trimmed after the batch's last EOS (the tower is causal: nothing before it changes), at `trim`
        (`encode_text`'s: True, or the length measured on the host).
        """
        mask_positions = self.cfg.method.mask_positions
        features = self.encoders.encode_text(ids, trim=trim if mask_positions == "caption" else False)
        valid = mask_network_positions(ids[:, : features.hidden.shape[1]], mask_positions)
        return features.pooled, features.hidden, valid


def mask_report(masks: Tensor) -> Terms:
    """Active mask dimensions per sample: mean, min and max over the global batch.

    Gathered (without gradient) so that every rank reports the same exact values: logging averages the ranks'
    scalars, which would turn per-rank minima and maxima into neither.
    """
    rank, world_size = world_info()
    active = active_dimensions(gather_features(masks.detach(), rank, world_size, with_grad=False)).float()
    return {"mask/active_mean": active.mean(), "mask/active_min": active.min(), "mask/active_max": active.max()}

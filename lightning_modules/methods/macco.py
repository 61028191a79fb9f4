"""MACCO-CLIP: masked composition concept modelling across text and image (ACL 2026;
docs/methods.md#macco-clip).

Every composition token of the caption (relation and attribute words, `comp_mask`) and the patches of one
grounded phrase (`patch_mask`) are replaced by learnable mask tokens at the embedding level, before the
positional embeddings. Each tower runs the full and the masked copy (the image tower as one 2B batch). Two
predictors reconstruct what was masked from the other modality:

- text predictor: queries = masked-text tokens, keys/values = **detached** full-image patches -> vocabulary
  logits at the masked token positions only (`L_mlm`; never reaches the image encoder);
- image predictor: queries = **detached** masked-image patches + fixed 2-D sin-cos positions, keys/values =
  full-text tokens (not detached, so `L_mim` trains the text encoder) -> LayerNorm, LayerNorm, Linear ->
  per-patch normalised pixels (`L_mim`).

Before either predictor every local token is averaged with its own sequence's global token. The image
encoder therefore learns only through `L_mca` (2B x 2B contrast) and `L_mir` (masked vs full, per modality).
`L = 1.0 L_mca + 0.1 L_mir + 20 L_mlm + 250 L_mim`; under DDP `L_mlm` and `L_mim` average over the valid
samples of the global batch. The predictors and mask tokens live outside `self.clip`, so they form the head
parameter group and are not part of the export (a vanilla open_clip checkpoint).

Official and ours. `configs/macco.yaml` reproduces the official code (hiker-lw/MACCO @ 97fbae1), checked
against its numbers by tests/test_macco_parity.py: no key padding mask in the image predictor (all 77 text
positions are keys, the full text runs untrimmed), every head tensor and both mask tokens under weight decay 0.01,
logit_scale in the head group (lr 1e-3, wd 0.01), the random rectangle's distribution
(`parsers.grounding.random_rectangle_mask`), out-of-crop boxes clamped onto the crop, one crop draw, and the
original's word -> token rule, `data.comp_mask_rule=first_bpe_match` (each relation / attribute string
BPE-encoded alone, "the" skipped, only its first contiguous id match in the caption masked; datamodules/masks.py).
`configs/macco_ours.yaml` [ours] changes six options, nothing else: `method.key_padding_mask=true` (keys after EOS
ignored; the full text then stops at the batch's last EOS, which is exact only with the mask),
`optim.logit_scale_group=backbone`, `optim.head_decay_1d=false`, `data.out_of_crop_boxes=drop`,
`data.box_aware_crop=true` and our word -> token rule, `data.comp_mask_rule=every_occurrence` (the exact character
spans of every composition word; also the schema default, so a config that does not set the rule gets ours).

MACCO + NegCLIP (`method.hard_negatives.captions: K`; off in the paper configs).
[paper] MACCO is orthogonal to hard-negative training: stacked on NegCLIP it still gains. The released code
has no hard negatives, so the form is ours, NegCLIP's own as CLIP-FT applies it: in training only, each
sample's K hard captions (`neg_text`, encoded by the base's shared `encode_hard_negatives`) are extra columns
of `L_mca`'s image-to-text logits for every image row, full and masked (`losses.masked_contrastive_loss`);
they are never anchors, and `L_mir`, `L_mlm`, `L_mim` do not see them.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor, nn

from modeling.encoders import ImageFeatures, TextFeatures
from lightning_modules.base import CompositionalCLIPModule, Terms
from modeling.losses import (ClipLoss, masked_contrastive_loss, masked_patch_loss, masked_token_loss,
                                      normalised_patch_targets)

MASK_TOKEN_STD = 0.02  # N(0, 0.02) init of both mask tokens [code]


# ----- small pure functions ---------------------------------------------------------------------------------
def inject_global(local: Tensor, global_: Tensor) -> Tensor:
    """Global-to-local injection: every local token [B, N, D] := (local + its own sequence's global [B, D]) / 2."""
    return (local + global_.unsqueeze(1)) / 2


def eos_positions(ids: Tensor) -> Tensor:
    """[B] index of each caption's EOS token (the highest id of CLIP's vocabulary, as open_clip pools)."""
    return ids.argmax(dim=-1)


def content_positions(ids: Tensor) -> Tensor:
    """[B, L] True at the caption's word tokens: after SOT, before EOS (SOT/EOS/padding are never masked)."""
    positions = torch.arange(ids.shape[1], device=ids.device)
    return (positions >= 1) & (positions < eos_positions(ids).unsqueeze(1))


def padding_positions(ids: Tensor) -> Tensor:
    """[B, L] True after each caption's EOS: the key padding mask of the text keys (True = ignored)."""
    positions = torch.arange(ids.shape[1], device=ids.device)
    return positions > eos_positions(ids).unsqueeze(1)


def sincos_2d_positions(dim: int, grid: Tuple[int, int]) -> Tensor:
    """Fixed 2-D sin-cos positions [rows * cols, dim], row-major like ViT's patches (MAE's construction).

    As in the original code (MAE's `get_2d_sincos_pos_embed`, whose meshgrid puts w first), the first half of
    the channels encodes the column index and the second half the row index; each half is [sin, cos] of the
    index times 1 / 10000^(k / (dim / 4)), k = 0 .. dim / 4 - 1.
    """
    if dim % 4:
        raise ValueError(f"2-D sin-cos positions need a width divisible by 4, got {dim}")
    rows, cols = torch.meshgrid(torch.arange(grid[0], dtype=torch.float64),
                                torch.arange(grid[1], dtype=torch.float64), indexing="ij")
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))

    def encode(index: Tensor) -> Tensor:
        angles = index.reshape(-1, 1) * omega
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([encode(cols), encode(rows)], dim=1).float()


def joint_embedding_dim(clip: nn.Module) -> int:
    """D, the width of the projected (joint) embedding space."""
    projection = clip.text_projection
    return projection.out_features if isinstance(projection, nn.Linear) else projection.shape[1]


# ----- predictors -------------------------------------------------------------------------------------------
class CrossAttentionBlock(nn.Module):
    """x += MHA(LN(x), LN(y), LN(y)); x += MLP(LN(x)) (pre-LN, GELU, MLP ratio 4) [code]."""

    def __init__(self, width: int, heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.ln_x = nn.LayerNorm(width)
        self.ln_y = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_mlp = nn.LayerNorm(width)
        hidden = int(width * mlp_ratio)
        self.mlp = nn.Sequential(OrderedDict([("c_fc", nn.Linear(width, hidden)), ("gelu", nn.GELU()),
                                              ("c_proj", nn.Linear(hidden, width))]))

    def forward(self, x: Tensor, y: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        keys = self.ln_y(y)
        x = x + self.attn(self.ln_x(x), keys, keys, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return x + self.mlp(self.ln_mlp(x))


def cross_attention_stack(width: int, depth: int, heads: int) -> nn.ModuleList:
    """`depth` blocks with the original's init (CLIP's transformer init, projections scaled by 1/sqrt(2 depth))."""
    blocks = nn.ModuleList([CrossAttentionBlock(width, heads) for _ in range(depth)])
    proj_std = width ** -0.5 * (2 * depth) ** -0.5
    for block in blocks:
        nn.init.normal_(block.attn.in_proj_weight, std=width ** -0.5)
        nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
        nn.init.normal_(block.mlp.c_fc.weight, std=(2 * width) ** -0.5)
        nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
    return blocks


def run_stack(blocks: Sequence[CrossAttentionBlock], x: Tensor, y: Tensor,
              key_padding_mask: Optional[Tensor] = None) -> Tensor:
    for block in blocks:
        x = block(x, y, key_padding_mask)
    return x


class TextPredictor(nn.Module):
    """Masked-text tokens attend to image patches; LN + Linear(D -> vocab) at the masked positions only.

    There is no self-attention among the queries, so each position's output depends on its own query only.
    """

    def __init__(self, width: int, depth: int, heads: int, vocab_size: int):
        super().__init__()
        self.blocks = cross_attention_stack(width, depth, heads)
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)
        nn.init.xavier_uniform_(self.head.weight)

    def features(self, queries: Tensor, keys: Tensor) -> Tensor:
        """Queries [B, L, D] after the cross-attention blocks over keys [B, P, D] -> [B, L, D]."""
        return run_stack(self.blocks, queries, keys)

    def logits(self, features: Tensor) -> Tensor:
        """LN + vocabulary head of features [..., D] -> [..., V], in fp32 (the CE over 49408 words)."""
        with torch.autocast(device_type=features.device.type, enabled=False):
            return self.head(self.ln(features.float()))

    def vocabulary_logits(self, features: Tensor, mask: Tensor) -> Tensor:
        """Logits [M, V] of the M positions where `mask` [B, L] is True, row-major: the masked rows are
        gathered first so that B x L x V (several GB at B=256) is never built."""
        return self.logits(features[mask])


class ImagePredictor(nn.Module):
    """Masked-image patches (Linear + fixed 2-D sin-cos positions) attend to text tokens; then LayerNorm,
    LayerNorm and Linear to the patch's p * p * 3 normalised pixels, laid out (row in patch, column in patch,
    channel) like `patchify`.

    The two LayerNorms in a row are the original's (its `ln` ends the cross-attention stack, its pixel head
    `proj` is LayerNorm + Linear); here `ln_post`, then `ln` + `head`, so trained weights map one to one.
    """

    def __init__(self, width: int, depth: int, heads: int, grid: Tuple[int, int], patch_size: int,
                 channels: int = 3):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.register_buffer("positions", sincos_2d_positions(width, grid), persistent=False)
        self.blocks = cross_attention_stack(width, depth, heads)
        self.ln_post = nn.LayerNorm(width)  # the original's `ln`
        self.ln = nn.LayerNorm(width)  # the original's `proj.0`
        self.head = nn.Linear(width, patch_size * patch_size * channels)  # the original's `proj.1`
        # the original's init of the pixel head
        nn.init.xavier_uniform_(self.head.weight, gain=1 / math.sqrt(width))
        nn.init.zeros_(self.head.bias)

    def forward(self, queries: Tensor, keys: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """Queries [B, P, D], keys [B, L, D] (`key_padding_mask` [B, L], True = ignored) -> pixels [B, P, K]."""
        x = self.embed(queries) + self.positions.to(queries.dtype)
        return self.head(self.ln(self.ln_post(run_stack(self.blocks, x, keys, key_padding_mask))))


# ----- the method -------------------------------------------------------------------------------------------
@dataclass
class MaccoOutputs:
    """Everything one MACCO forward computed (tests read the intermediate tensors)."""

    text: TextFeatures  # full captions, at length L' (77 without the key padding mask: every position a key)
    masked_text: TextFeatures  # masked captions, at length L_m <= L' (up to the batch's last EOS)
    image: ImageFeatures  # full images
    masked_image: ImageFeatures
    ids: Tensor  # [B, L'] token ids at the full text forward's (possibly trimmed) length
    text_mask: Tensor  # [B, L'] masked composition tokens (all before EOS, so within the first L_m)
    patch_mask: Tensor  # [B, P] masked patches
    text_predictor_features: Tensor  # [B, L_m, D] before the vocabulary head
    vocabulary_logits: Tensor  # [M, V] at the masked token positions, row-major
    pixel_predictions: Tensor  # [B, P, p * p * 3]


def _split_image(both: ImageFeatures) -> Tuple[ImageFeatures, ImageFeatures]:
    halves = [ImageFeatures(pooled=p, patches=t) for p, t in zip(both.pooled.chunk(2), both.patches.chunk(2))]
    return halves[0], halves[1]


class MaccoCLIP(CompositionalCLIPModule):
    """MACCO-CLIP; needs `data.masks=true` (`comp_mask` and `patch_mask` in every batch).

    Config: `method.{mca,mir,mlm,mim}_weight`, `method.{text,image}_predictor_depth`, `method.predictor_heads`,
    `method.key_padding_mask` (mask text keys after EOS in the image predictor [ours]; the original has none),
    `method.mca_masked` (which masked copies L_mca contrasts: "both" [paper], "text", "image" or "none" [ours]),
    `method.hard_negatives.captions` (NegCLIP's hard captions as extra image-to-text columns of `L_mca`, training only).
    """

    uses_hard_negatives = True
    # the composition tokens and one grounded phrase's patches, replaced by the mask tokens (fit refuses to
    # start without data.masks=true)
    required_masks: Tuple[str, ...] = ("comp_mask", "patch_mask")

    def __init__(self, cfg: DictConfig):
        super().__init__(cfg)
        method = cfg.method
        # Four tower forwards of B samples each: the towers keep each block's MLP pre-activation only and compute
        # the activation again in the backward (the same numbers, less memory; encoders.mlp_recomputing_activation).
        self.encoders.recompute_activations = True
        width = joint_embedding_dim(self.clip)
        self.text_mask_token = nn.Parameter(torch.randn(self.encoders.text_width) * MASK_TOKEN_STD)
        self.img_mask_token = nn.Parameter(torch.randn(self.encoders.vision_width) * MASK_TOKEN_STD)
        self.text_predictor = TextPredictor(width, method.text_predictor_depth, method.predictor_heads,
                                            self.clip.vocab_size)
        self.patch_size = self.clip.visual.conv1.kernel_size[0]
        self.image_predictor = ImagePredictor(width, method.image_predictor_depth, method.predictor_heads,
                                              self.encoders.grid_size, self.patch_size)
        self.key_padding_mask = method.key_padding_mask
        # Trimming after the batch's last EOS is exact only when the keys after EOS are masked; without the
        # mask every padding position is a key, as in the original (77 keys), so the text runs untrimmed.
        self.trim_text = method.key_padding_mask
        self.clip_loss = ClipLoss(local_loss=True, gather_with_grad=True)

    def compute_terms(self, batch: dict) -> Tuple[Terms, Terms]:
        _check_masks(batch)
        out = self.macco_forward(batch)
        negatives = self.encode_hard_negatives(batch) if self.trains_on_hard_negatives else None
        raw = self.raw_losses(out, batch["image"], negatives)
        m = self.cfg.method
        weights = {"mca": m.mca_weight, "mir": m.mir_weight, "mlm": m.mlm_weight, "mim": m.mim_weight}
        terms = {f"{name}_loss": weights[name] * value for name, value in raw.items()}
        report = {f"unweighted/{name}": value.detach() for name, value in raw.items()}
        return terms, {**report, **mask_report(out.text_mask, out.patch_mask)}

    # ----- forward -----------------------------------------------------------------------------------------
    def macco_forward(self, batch: dict) -> MaccoOutputs:
        """Both towers on full + masked copies, then both predictors (with the stop-gradients of
        docs/methods.md#forward-and-predictors)."""
        ids = batch["text"]
        text_mask = batch["comp_mask"].bool() & content_positions(ids)
        text, masked_text = self.encode_text_pair(ids, text_mask, self.trim_length(batch, "text"))
        length = text.tokens.shape[1]  # the trimmed length of the text forward: targets and masks follow it
        ids, text_mask = ids[:, :length], text_mask[:, :length]
        patch_mask = batch["patch_mask"].bool()
        image, masked_image = self.encode_image_pair(batch["image"], patch_mask)
        # L_mlm must not reach the image encoder: its keys are detached.
        image_keys = inject_global(image.patches, image.pooled).detach()
        # Each query attends to the image alone (no self-attention among queries): the masked positions' outputs
        # are the same at any query length, so the predictor runs on the masked copy's length L_m only.
        text_features = self.text_predictor.features(inject_global(masked_text.tokens, masked_text.pooled),
                                                     image_keys)
        # L_mim must not reach the image encoder (queries detached) but does train the text encoder (keys not).
        image_queries = inject_global(masked_image.patches, masked_image.pooled).detach()
        padding = padding_positions(ids) if self.key_padding_mask else None
        pixels = self.image_predictor(image_queries, inject_global(text.tokens, text.pooled), padding)
        vocabulary_logits = self.text_predictor.vocabulary_logits(text_features, text_mask[:, :text_features.shape[1]])
        return MaccoOutputs(text, masked_text, image, masked_image, ids, text_mask, patch_mask, text_features,
                            vocabulary_logits, pixels)

    def encode_text_pair(self, ids: Tensor, text_mask: Tensor, trim: Union[bool, int] = True
                         ) -> Tuple[TextFeatures, TextFeatures]:
        """Full and masked captions; masked tokens get `text_mask_token` before the positions.

        The masked copy always stops at the batch's last EOS: only its EOS (pooled) and its masked positions (all
        before EOS) are read, and the tower is causal, so the positions after it change nothing but the memory.
        The full copy runs every position without the key padding mask (each is a key of the image predictor,
        as in the original) and stops at the last EOS with it. Two B forwards, each row computed as in one 2B
        forward of the original (up to float rounding). `trim` is `encode_text`'s (True, or the host length).
        """
        text = self.encoders.encode_text(ids, trim=trim if self.trim_text else False)
        masked_text = self.encoders.encode_text(ids, replace=text_mask, mask_token=self.text_mask_token, trim=trim)
        return text, masked_text

    def encode_image_pair(self, images: Tensor, patch_mask: Tensor) -> Tuple[ImageFeatures, ImageFeatures]:
        """Full and masked images in one 2B forward; masked patch embeddings become `img_mask_token`."""
        replace = torch.cat([torch.zeros_like(patch_mask), patch_mask])
        both = self.encoders.encode_image(torch.cat([images, images]), replace=replace,
                                          mask_token=self.img_mask_token)
        return _split_image(both)

    # ----- losses ------------------------------------------------------------------------------------------
    def raw_losses(self, out: MaccoOutputs, images: Tensor, negatives: Optional[Tensor] = None) -> Terms:
        """The four unweighted terms (docs/methods.md#macco-losses): L_mca, L_mir, L_mlm, L_mim.

        `negatives` [B, K, D]: L2-normalised hard captions, extra image-to-text columns of L_mca only.
        """
        scale = self.clip.logit_scale.exp()
        image, masked_image = F.normalize(out.image.pooled, dim=-1), F.normalize(out.masked_image.pooled, dim=-1)
        text, masked_text = F.normalize(out.text.pooled, dim=-1), F.normalize(out.masked_text.pooled, dim=-1)
        masked = self.cfg.method.mca_masked  # [ours] which masked copies L_mca contrasts (the paper: both)
        mca = masked_contrastive_loss(image, masked_image if masked in ("both", "image") else None, text,
                                      masked_text if masked in ("both", "text") else None, scale, negatives)
        mir = (self.clip_loss(masked_text, text, scale) + self.clip_loss(masked_image, image, scale)) / 2
        mlm = masked_token_loss(out.vocabulary_logits, out.ids[out.text_mask], out.text_mask)
        targets = normalised_patch_targets(images, self.patch_size)
        mim = masked_patch_loss(out.pixel_predictions, targets, out.patch_mask)
        return {"mca": mca, "mir": mir, "mlm": mlm, "mim": mim}


def mask_report(text_mask: Tensor, patch_mask: Tensor) -> Terms:
    """Masked tokens and patches of this device's batch, and the fraction of samples with an empty mask
    (those are left out of L_mlm / L_mim)."""
    return {"mask/text_tokens": text_mask.sum().float(), "mask/image_patches": patch_mask.sum().float(),
            "mask/text_empty_fraction": (~text_mask.any(dim=1)).float().mean(),
            "mask/image_empty_fraction": (~patch_mask.any(dim=1)).float().mean()}


def _check_masks(batch: dict) -> None:
    if "comp_mask" not in batch or "patch_mask" not in batch:
        raise KeyError("MACCO-CLIP needs comp_mask and patch_mask in every batch: set data.masks=true and run "
                       "python -m datamodules.preprocess --config ... first (patch masks need a grounder)")

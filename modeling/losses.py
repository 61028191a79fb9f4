"""Contrastive losses, plain torch (no Lightning), exact under data parallelism.

`ClipLoss` follows open_clip's semantics: with `gather_with_grad=True` every rank's features are gathered
through an autograd-aware all_gather, whose backward sums each rank's gradient for its slice; with
`local_loss=True` each rank scores only its own rows against all columns (B x B*W logits, labels offset by
B * rank). Averaging the ranks' parameter gradients (DDP) then gives exactly the single-process big-batch
gradient. MACCO's masked means (`L_mlm`, `L_mim`) gather their per-sample values the same way, so that they
average over the valid samples of the global batch. Rank and world size are read at call time, never captured
at construction.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


def world_info() -> Tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_equal_batches(local_batch: int, world_size: int, device: torch.device) -> None:
    """All ranks must hold the same batch size, else all_gather hangs or mixes samples silently."""
    sizes = torch.tensor([local_batch], device=device)
    gathered = [torch.zeros_like(sizes) for _ in range(world_size)]
    dist.all_gather(gathered, sizes)
    if any(int(s) != local_batch for s in gathered):
        raise RuntimeError(f"unequal per-rank batch sizes {[int(s) for s in gathered]}: use drop_last=True "
                           f"for training data")


class _AllGatherWithGrad(torch.autograd.Function):
    """all_gather along dim 0 whose backward hands each rank the sum over ranks of its slice's gradient."""

    @staticmethod
    def forward(ctx, features: Tensor) -> Tensor:
        ctx.rank, ctx.batch = dist.get_rank(), features.shape[0]
        slices = [torch.empty_like(features) for _ in range(dist.get_world_size())]
        dist.all_gather(slices, features.contiguous())
        return torch.cat(slices, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)  # every rank's loss depends on every slice
        return grad[ctx.rank * ctx.batch:(ctx.rank + 1) * ctx.batch]


def gather_features(features: Tensor, rank: int, world_size: int, with_grad: bool) -> Tensor:
    """Concatenate `features` [B, ...] of every rank in rank order -> [W*B, ...].

    Without `with_grad`, other ranks' slices are constants and this rank's own slice is put back as the
    local tensor so that its gradient still flows (open_clip's behaviour).
    """
    if world_size == 1:
        return features
    if with_grad:
        return _AllGatherWithGrad.apply(features)
    slices = [torch.zeros_like(features) for _ in range(world_size)]
    dist.all_gather(slices, features.detach())
    slices[rank] = features
    return torch.cat(slices, dim=0)


def _fp32(*tensors: Optional[Tensor]):
    return tuple(t.float() if t is not None else None for t in tensors)


class ClipLoss(nn.Module):
    """Symmetric InfoNCE of CLIP, optionally with hard-negative caption columns (NegCLIP).

    `L = 1/2 [CE(s I T^T, y) + CE(s T I^T, y)]` over L2-normalised features. Hard negatives
    `neg_text_features` [B, K, D] are extra columns of the image-to-text logits only (never anchors).
    Logits and cross-entropy run in fp32 even under bf16 autocast.

    Args:
        local_loss: score local rows against gathered columns (B x W*B) instead of the full W*B x W*B.
        gather_with_grad: gather features with gradient (exact) instead of as constants.
    """

    def __init__(self, local_loss: bool = True, gather_with_grad: bool = True):
        super().__init__()
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor,
                neg_text_features: Optional[Tensor] = None) -> Tensor:
        with torch.autocast(device_type=image_features.device.type, enabled=False):
            return self._loss(*_fp32(image_features, text_features, logit_scale, neg_text_features))

    def _loss(self, images: Tensor, texts: Tensor, logit_scale: Tensor, negatives: Optional[Tensor]) -> Tensor:
        rank, world_size = world_info()
        if world_size > 1:
            check_equal_batches(images.shape[0], world_size, images.device)
        all_images = gather_features(images, rank, world_size, self.gather_with_grad)
        all_texts = gather_features(texts, rank, world_size, self.gather_with_grad)
        text_columns = all_texts
        if negatives is not None:
            all_negatives = gather_features(negatives, rank, world_size, self.gather_with_grad)
            text_columns = torch.cat([all_texts, all_negatives.flatten(0, 1)], dim=0)
        if self.local_loss:
            rows_image, rows_text = images, texts
            labels = torch.arange(images.shape[0], device=images.device) + images.shape[0] * rank
        else:
            rows_image, rows_text = all_images, all_texts
            labels = torch.arange(all_images.shape[0], device=images.device)
        logits_per_image = logit_scale * rows_image @ text_columns.T
        logits_per_text = logit_scale * rows_text @ all_images.T
        return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def cae_attribution_loss(attr_obj: Tensor, attr_comp: Tensor, valid: Tensor, margin: float = 0.0) -> Tensor:
    """[ours] CLIP-CAE's attribution term per caption: mean over valid captions of max(0, A_obj - A_comp + margin).

    Args:
        attr_obj: [B] mean attribution of each caption's object tokens.
        attr_comp: [B] mean attribution of its relation and attribute tokens.
        valid: [B] bool, captions with both object and composition tokens (the others do not enter the loss).
        margin: eps of docs/methods.md#the-attribution-hinge (default 0).

    A batch without any valid caption gives 0, still connected to the graph (no NaN from an empty mean).
    """
    hinge = (attr_obj - attr_comp + margin).clamp(min=0)
    weights = valid.to(hinge.dtype)
    return (hinge * weights).sum() / weights.sum().clamp(min=1)


def cae_batch_attribution_loss(attribution: Tensor, obj_mask: Tensor, comp_mask: Tensor,
                               margin: float = 0.0) -> Tuple[Tensor, Tensor, Tensor]:
    """CLIP-CAE's attribution term as the paper defines it: one hinge per (global) batch.

    `L_attr = max(0, A_obj - A_comp + margin)`, A_obj (A_comp) the mean attribution over all object
    (composition) tokens of the batch. Under data parallelism the batch is the global batch: each rank's token
    sums are gathered with the autograd-aware gather and its counts summed, so every rank computes the same
    loss, and the ranks' averaged parameter gradients (DDP) equal the single-process gradient of the global
    batch (each rank's gather backward hands it the summed gradient of its sums: W times its share, divided by
    W again by DDP's mean).

    Args:
        attribution: [B, L] per-token attribution; obj_mask, comp_mask: [B, >= L] bool token masks.
        margin: eps (default 0).

    Returns:
        (loss, A_obj, A_comp) as fp32 scalars. A batch without object or without composition tokens gives a
        loss of 0, still connected to the graph (no NaN).
    """
    with torch.autocast(device_type=attribution.device.type, enabled=False):
        attribution = attribution.float()
        masks = torch.stack([obj_mask[:, : attribution.shape[1]], comp_mask[:, : attribution.shape[1]]])
        masks = masks.to(attribution.dtype)
        sums = (attribution.unsqueeze(0) * masks).sum(dim=(1, 2))  # [2]: object, composition
        counts = masks.sum(dim=(1, 2)).detach()
        rank, world_size = world_info()
        if world_size > 1:
            sums = gather_features(sums.unsqueeze(0), rank, world_size, with_grad=True).sum(dim=0)
            counts = counts.clone()
            dist.all_reduce(counts)
        attr_obj, attr_comp = sums / counts.clamp(min=1)
        hinge = (attr_obj - attr_comp + margin).clamp(min=0)
        present = (counts > 0).all()  # decided on the device: reading it back would wait for the step
        return torch.where(present, hinge, hinge * 0.0), attr_obj, attr_comp


# ----- MACCO-CLIP (docs/methods.md#macco-losses) -----------------------------------------------------------
def masked_contrastive_loss(images: Tensor, masked_images: Optional[Tensor], texts: Tensor,
                            masked_texts: Optional[Tensor], logit_scale: Tensor,
                            neg_text_features: Optional[Tensor] = None) -> Tensor:
    """MACCO's `L_mca`: InfoNCE over [I; I~] x [T; T~] (2B x 2B) with labels [0..B-1, 0..B-1], both directions.

    Masked samples are extra anchors whose positive is the full sample of the other modality, and extra
    negatives for every other anchor. All inputs [B, D] are L2-normalised. Under data parallelism each rank
    scores its own rows against the gathered columns [T_all; T~_all] (features gathered with gradient,
    labels offset by B * rank), so the mean over ranks equals the single-process loss of the global batch.

    `masked_images` or `masked_texts` None [ours, `method.mca_masked`]: that modality's masked copies are left
    out, as anchors and as columns (with both None, CLIP's B x B loss): the contrast with the masked captions
    only ([I] x [T; T~] and back), or with the masked images only ([I; I~] x [T]).

    `neg_text_features` [B, K, D] (MACCO + NegCLIP [ours: the paper states the combination, not its form]):
    NegCLIP's hard captions, gathered like the others and appended as extra columns of the image-to-text
    logits of every image row (full and masked), as `ClipLoss` appends them; never anchors, so the
    text-to-image direction is unchanged.
    """
    with torch.autocast(device_type=images.device.type, enabled=False):
        images, masked_images, texts, masked_texts, logit_scale, negatives = _fp32(
            images, masked_images, texts, masked_texts, logit_scale, neg_text_features)
        rank, world_size = world_info()
        if world_size > 1:
            check_equal_batches(images.shape[0], world_size, images.device)
        gather = lambda x: gather_features(x, rank, world_size, with_grad=True)  # noqa: E731
        image_rows = [x for x in (images, masked_images) if x is not None]
        text_rows = [x for x in (texts, masked_texts) if x is not None]
        # the full samples' columns come first, so the labels index them whichever masked copies follow
        text_columns = torch.cat([gather(x) for x in text_rows])
        image_columns = torch.cat([gather(x) for x in image_rows])
        labels = torch.arange(images.shape[0], device=images.device) + images.shape[0] * rank
        # the hard captions come after every positive column: the labels are unchanged
        image_to_text_columns = (text_columns if negatives is None
                                 else torch.cat([text_columns, gather(negatives).flatten(0, 1)]))
        image_to_text = F.cross_entropy(logit_scale * torch.cat(image_rows) @ image_to_text_columns.T,
                                        labels.repeat(len(image_rows)))
        text_to_image = F.cross_entropy(logit_scale * torch.cat(text_rows) @ image_columns.T,
                                        labels.repeat(len(text_rows)))
        return (image_to_text + text_to_image) / 2


def mean_over_masked_samples(per_item: Tensor, mask: Tensor) -> Tensor:
    """Mean over positions where `mask` [B, N] is True within each sample, then over samples with >= 1 such.

    `per_item` is [B, N]. Samples with an empty mask are left out (MACCO's averaging for L_mlm / L_mim); a
    batch without any masked position gives 0, still connected to the graph (no NaN from an empty mean).

    Under data parallelism the second mean runs over the valid samples of the GLOBAL batch: every rank's
    per-sample means are gathered with gradient and divided by the global count of valid samples, so every
    rank holds the global value, and the ranks' gradients averaged by DDP equal the single-process gradient
    of the global batch (a per-rank mean would weight ranks with fewer valid samples too much).
    """
    weights = mask.to(per_item.dtype)
    counts = weights.sum(dim=1)
    valid = (counts > 0).to(per_item.dtype)
    per_sample = (per_item * weights).sum(dim=1) / counts.clamp(min=1)  # 0 for an empty mask
    rank, world_size = world_info()
    if world_size > 1:
        check_equal_batches(per_sample.shape[0], world_size, per_sample.device)
    per_sample = gather_features(per_sample, rank, world_size, with_grad=True)
    valid = gather_features(valid, rank, world_size, with_grad=False).detach()  # a count: no gradient
    return per_sample.sum() / valid.sum().clamp(min=1)


def masked_token_loss(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """MACCO's `L_mlm`: cross-entropy at the masked token positions only.

    Args:
        logits: [M, V] vocabulary logits of the M masked positions, in `mask.nonzero()` (row-major) order;
            the B x L x V tensor is never built (several GB at B=256, V=49408).
        targets: [M] token ids at those positions.
        mask: [B, L] bool, the masked positions.

    Returns:
        Mean per sample over its masked tokens, then mean over the samples with >= 1 masked token of the
        global batch (fp32; see `mean_over_masked_samples`).
    """
    with torch.autocast(device_type=logits.device.type, enabled=False):
        per_token = F.cross_entropy(logits.float(), targets, reduction="none")
        scattered = torch.zeros(mask.shape, dtype=per_token.dtype, device=per_token.device)
        scattered = scattered.masked_scatter(mask, per_token)
        return mean_over_masked_samples(scattered, mask)


def patchify(images: Tensor, patch_size: int) -> Tensor:
    """Images [B, C, H, W] -> patches [B, P, p * p * C], P row-major over the grid (as ViT's patch order).

    Within a patch the layout is (row in patch, column in patch, channel), channel fastest: MAE's
    `nchpwq -> nhwpqc`, which is what the original MACCO code uses and what the pixel head predicts.
    """
    batch, channels, height, width = images.shape
    if height % patch_size or width % patch_size:
        raise ValueError(f"image {height}x{width} is not a whole number of {patch_size}-pixel patches")
    rows, cols = height // patch_size, width // patch_size
    x = images.reshape(batch, channels, rows, patch_size, cols, patch_size)
    x = torch.einsum("nchpwq->nhwpqc", x)
    return x.reshape(batch, rows * cols, patch_size * patch_size * channels)


def normalised_patch_targets(images: Tensor, patch_size: int, eps: float = 1e-6) -> Tensor:
    """MACCO's pixel targets: each patch of the (augmented, CLIP-normalised) input standardised on its own,
    (x - mean) / sqrt(var + eps) with the unbiased variance over the patch's p * p * C values. [B, P, p*p*C]"""
    patches = patchify(images.float(), patch_size)
    mean = patches.mean(dim=-1, keepdim=True)
    var = patches.var(dim=-1, keepdim=True, unbiased=True)
    return (patches - mean) / (var + eps).sqrt()


def masked_patch_loss(predicted: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """MACCO's `L_mim`: per-patch MSE (mean over the p*p*C values), at masked patches only.

    Args:
        predicted: [B, P, K] pixel predictions; target: [B, P, K] (`normalised_patch_targets`).
        mask: [B, P] bool, the masked patches.

    Returns:
        Mean per sample over its masked patches, then mean over the samples with >= 1 masked patch of the
        global batch (fp32; see `mean_over_masked_samples`).
    """
    with torch.autocast(device_type=predicted.device.type, enabled=False):
        per_patch = (predicted.float() - target.float()).pow(2).mean(dim=-1)
        return mean_over_masked_samples(per_patch, mask)

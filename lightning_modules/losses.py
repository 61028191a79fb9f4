"""Contrastive losses, plain torch (no Lightning), exact under data parallelism.

`ClipLoss` follows open_clip's semantics: with `gather_with_grad=True` every rank's features are gathered
through an autograd-aware all_gather, whose backward sums each rank's gradient for its slice; with
`local_loss=True` each rank scores only its own rows against all columns (B x B*W logits, labels offset by
B * rank). Averaging the ranks' parameter gradients (DDP) then gives exactly the single-process big-batch
gradient. Rank and world size are read at call time, never captured at construction.
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
    """CLIP-CAE's attribution term: mean over valid captions of max(0, A_obj - A_comp + margin).

    Args:
        attr_obj: [B] mean attribution of each caption's object tokens.
        attr_comp: [B] mean attribution of its relation and attribute tokens.
        valid: [B] bool, captions with both object and composition tokens (the others do not enter the loss).
        margin: eps of METHODS.md (default 0).

    A batch without any valid caption gives 0, still connected to the graph (no NaN from an empty mean).
    """
    hinge = (attr_obj - attr_comp + margin).clamp(min=0)
    weights = valid.to(hinge.dtype)
    return (hinge * weights).sum() / weights.sum().clamp(min=1)

"""Long-CLIP's positional-embedding stretch: a CLIP text encoder with a longer context (ECCV 2024).

Long-CLIP (beichenzbc/Long-CLIP, `load_from_clip`), whose code SmartCLIP's official training reuses, gives a
77-position CLIP text encoder 248 positions without retraining from scratch. With keep = 20 and factor 4:

- positions 0..19 are kept as they are, and stay **frozen** during fine-tuning (the original holds them in a
  `positional_embedding` with requires_grad=False and adds a trainable `positional_embedding_res` only at
  positions >= 20);
- each later old position p (20 <= p < 76) and its successor p + 1 become 4 new positions
  20 + 4 (p - 20) + j, j = 0..3, linearly interpolated: `((4 - j) e_p) / 4 + (j e_{p+1}) / 4`;
- the last old position 76 becomes the last 4 positions, linearly *extrapolated* from its step to 76:
  `e_76 + (j (e_76 - e_75)) / 4`, j = 0..3;

so 4 * 77 - 3 * 20 = 248 positions. Long-CLIP and SmartCLIP stretch the fp16 OpenAI weights in fp16; the
arithmetic here runs in a chosen dtype with the original's order of operations, so float16 gives the original's
values bit for bit.

A single open_clip `positional_embedding` of the new length replaces the pair of the original: the kept rows'
gradients are zeroed before every optimizer step and their values restored after it (weight decay would move
them), which trains exactly the original's `positional_embedding_res` rows and keeps the model a plain
open_clip CLIP, exportable under a config with the new context length.
"""
from __future__ import annotations

import copy
from typing import Dict

import open_clip
import torch
from torch import Tensor, nn

from modeling.encoders import QUICKGELU_SUFFIX, BuiltModel

STRETCH_DTYPES: Dict[str, torch.dtype] = {"float16": torch.float16, "float32": torch.float32}


def stretch_factor(length: int, context_length: int, keep: int) -> int:
    """The integer f with `f * length - (f - 1) * keep == context_length` (77, 248, 20 -> 4)."""
    if not 1 <= keep < length - 1:
        raise ValueError(f"model.keep_positions={keep} must leave at least two positions of {length} to stretch")
    factor, remainder = divmod(context_length - keep, length - keep)
    if remainder or factor < 2:
        raise ValueError(f"model.context_length={context_length}: Long-CLIP's stretch of {length} positions "
                         f"keeping {keep} gives f * {length} - (f - 1) * {keep} positions for an integer f >= 2 "
                         f"(e.g. {4 * length - 3 * keep} with f = 4)")
    return factor


def stretch_positional_embedding(positions: Tensor, keep: int, factor: int,
                                 compute_dtype: torch.dtype = torch.float16) -> Tensor:
    """Long-CLIP's stretch of positional embeddings [L, W] -> [factor L - (factor - 1) keep, W] (module doc).

    Computed in `compute_dtype` with the original's order of operations, returned in the input's dtype.
    """
    old = positions.detach().to(compute_dtype)
    steps = torch.arange(factor, dtype=compute_dtype, device=old.device).view(1, factor, 1)
    first, second = old[keep:-1].unsqueeze(1), old[keep + 1:].unsqueeze(1)
    between = ((factor - steps) * first) / factor + (steps * second) / factor
    last, step = old[-1], old[-1] - old[-2]
    beyond = last + (steps[0] * step) / factor
    stretched = torch.cat([old[:keep], between.reshape(-1, old.shape[1]), beyond])
    return stretched.to(positions.dtype)


def causal_attention_mask(length: int) -> Tensor:
    """CLIP's additive causal mask [length, length]: -inf above the diagonal."""
    return torch.full((length, length), float("-inf")).triu_(1)


def stretched_model_name(name: str, context_length: int) -> str:
    """The export's model name: `ViT-B-16-quickgelu` -> `ViT-B-16-ctx248-quickgelu` (the suffix stays last)."""
    if name.endswith(QUICKGELU_SUFFIX):
        return f"{name[: -len(QUICKGELU_SUFFIX)]}-ctx{context_length}{QUICKGELU_SUFFIX}"
    return f"{name}-ctx{context_length}"


def stretch_text_context(built: BuiltModel, context_length: int, keep: int,
                         compute_dtype: torch.dtype = torch.float16) -> BuiltModel:
    """The built model with Long-CLIP's stretched text context, its tokenizer, name and config.

    Changes `built.model` in place: a longer `positional_embedding` (a new Parameter), the causal mask of the
    new length and `context_length`. The returned config (for the export) has the new context length.
    """
    model = built.model
    if not isinstance(getattr(model, "positional_embedding", None), nn.Parameter) or built.config is None:
        raise ValueError(f"{built.name}: the positional-embedding stretch needs an open_clip CLIP with a "
                         f"built-in text tower and a known model config")
    old = model.positional_embedding
    factor = stretch_factor(old.shape[0], context_length, keep)
    model.positional_embedding = nn.Parameter(stretch_positional_embedding(old, keep, factor, compute_dtype),
                                              requires_grad=old.requires_grad)
    model.attn_mask = causal_attention_mask(context_length).to(old.device)
    model.context_length = context_length
    config = copy.deepcopy(built.config)
    config["text_cfg"]["context_length"] = context_length
    tokenizer = open_clip.get_tokenizer(built.name, context_length=context_length)
    return BuiltModel(model, stretched_model_name(built.name, context_length), built.preprocess_train,
                      built.preprocess_val, tokenizer, config)


def zero_kept_gradients(positional_embedding: nn.Parameter, keep: int) -> None:
    """Zero the gradient of the first `keep` (frozen) positions, before the optimizer (and clipping) see it."""
    if positional_embedding.grad is not None:
        positional_embedding.grad[:keep].zero_()


def restore_kept_positions(positional_embedding: nn.Parameter, kept: Tensor) -> None:
    """Put the frozen positions back after an optimizer step (AdamW's decoupled weight decay moves them)."""
    with torch.no_grad():
        positional_embedding[: kept.shape[0]].copy_(kept)

"""Per-token text attribution and Grad-ECLIP image maps for CLIP (METHODS.md: CLIP-CAE, Grad-ECLIP).

Plain torch, no Lightning. Every text attribution returns `a` [B, L] for the positive pairs (image b,
caption b), non-zero only on the content tokens 1..EOS-1 (SOT, EOS and padding are never attributed):

- `attention`: attn[EOS, t], averaged (or maxed) over heads and over the chosen layers;
- `gradcam`: Chefer et al.'s relevance: R = I; for each layer from `start_layer`,
  E = mean_heads(relu(dS/dA * A)), R <- R + E R; a_t = R[EOS, t];
- `perturbation`: a_t = S(I, T) - S(I, T with t's word replaced by `replacement_id`), one forward per word,
  batched;
- `gradient`: a_t = sum_d |dS / de_{t,d}| over the token embedding e_t;
- `grad_eclip`: Grad-ECLIP's text map (last `eclip_layers` blocks, EOS row, loosened attention).

S(I, T) is the cosine of the L2-normalised image and text embeddings of the pair. The gradient-based
methods take `create_graph=True` during training, so the attribution (and a loss on it) is differentiable
with respect to the weights (double backward). With `renormalise` (default) `a` is divided by its sum (of
absolute values) over the content tokens, which makes a margin between token groups scale-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

# The options are the config schema's `method.attribution` section (fields and defaults documented there).
from lightning_modules.config import AttributionConfig as AttributionOptions
from lightning_modules.encoders import AttentionTrace, CLIPEncoders, TextFeatures, run_block

HEADS = ("multi", "single")


def attribution_options(section) -> AttributionOptions:
    """Options from a config section (`method.attribution`) or any mapping with the same keys."""
    keys = AttributionOptions.__dataclass_fields__
    values = {key: section[key] for key in keys if key in section}
    if values.get("layers") is not None:
        values["layers"] = list(values["layers"])
    return AttributionOptions(**values)


@dataclass
class TextAttributionInputs:
    """One batch of positive pairs: image embeddings, caption ids and the text forward with traces."""

    encoders: CLIPEncoders
    ids: Tensor  # [B, L]
    image: Tensor  # [B, D], L2-normalised image embeddings of the pairs
    text: TextFeatures  # from encoders.encode_text(ids, attn=True)
    word_ends: Optional[Tensor] = None  # [vocab] bool: the token ends a word (perturbation's word groups)
    extra: Dict[str, Tensor] = field(default_factory=dict)

    @cached_property
    def target(self) -> Tensor:
        """S(I, T) per pair [B]."""
        return pair_similarity(self.image, self.text.pooled)

    @cached_property
    def eos(self) -> Tensor:
        return eos_positions(self.ids)

    @cached_property
    def content(self) -> Tensor:
        return content_mask(self.ids)


def pair_similarity(image: Tensor, text_pooled: Tensor) -> Tensor:
    return (F.normalize(image, dim=-1) * F.normalize(text_pooled, dim=-1)).sum(dim=-1)


def eos_positions(ids: Tensor) -> Tensor:
    """Position of EOS per caption: open_clip's EOT token has the largest id (its own pooling rule)."""
    return ids.argmax(dim=-1)


def content_mask(ids: Tensor) -> Tensor:
    """[B, L] True on positions 1..EOS-1 (the caption's own tokens)."""
    positions = torch.arange(ids.shape[1], device=ids.device)
    return (positions > 0) & (positions < eos_positions(ids).unsqueeze(1))


def restrict_and_renormalise(attribution: Tensor, content: Tensor, renormalise: bool) -> Tensor:
    """Zero outside the content tokens; optionally divide by the content sum of |a| (all-zero rows stay zero).

    For the four non-negative methods that is the sum itself (a sums to 1); perturbation drops can be
    negative, and dividing a signed vector by its sum would explode when the sum is near zero.
    """
    attribution = attribution * content[:, : attribution.shape[1]].to(attribution.dtype)
    if not renormalise:
        return attribution
    total = attribution.abs().sum(dim=1, keepdim=True)
    safe = torch.where(total.abs() > 1e-12, total, torch.ones_like(total))
    return torch.where(total.abs() > 1e-12, attribution / safe, torch.zeros_like(attribution))


def _rows_at(matrices: Tensor, rows: Tensor) -> Tensor:
    """matrices [B, ..., N, N] -> the row `rows[b]` of each sample's matrices, [B, ..., N]."""
    index = rows.view(-1, *([1] * (matrices.dim() - 2)), 1).expand(*matrices.shape[:-2], 1, matrices.shape[-1])
    return matrices.gather(-2, index).squeeze(-2)


def layer_indices(count: int, layers: Optional[Sequence[int]]) -> List[int]:
    if layers is None:
        return list(range(count))
    chosen = [layer % count for layer in layers]
    if any(not -count <= layer < count for layer in layers):
        raise ValueError(f"attribution layers {list(layers)} out of range for {count} blocks")
    return chosen


def attention_attribution(inputs: TextAttributionInputs, options: AttributionOptions,
                          create_graph: bool = False) -> Tensor:
    """Mean over the chosen layers of the head-reduced attention from EOS to each token."""
    attentions = inputs.text.attentions
    if attentions is None:
        raise ValueError("attention attribution needs encode_text(..., attn=True)")
    rows = [_rows_at(attentions[i], inputs.eos) for i in layer_indices(len(attentions), options.layers)]
    stacked = torch.stack(rows)  # [layers, B, heads, L]
    if options.head_reduce == "mean":
        per_layer = stacked.mean(dim=2)
    elif options.head_reduce == "max":
        per_layer = stacked.amax(dim=2)
    else:
        raise ValueError(f"head_reduce must be 'mean' or 'max', got {options.head_reduce!r}")
    return per_layer.mean(dim=0)


def gradcam_attribution(inputs: TextAttributionInputs, options: AttributionOptions,
                        create_graph: bool = False) -> Tensor:
    """Chefer relevance propagation from `start_layer` to the last block, read at the EOS row."""
    attentions = inputs.text.attentions
    if attentions is None:
        raise ValueError("gradcam attribution needs encode_text(..., attn=True)")
    if not -len(attentions) <= options.start_layer < len(attentions):
        raise ValueError(f"start_layer {options.start_layer} out of range for {len(attentions)} blocks")
    start = options.start_layer % len(attentions)
    used = attentions[start:]
    grads = torch.autograd.grad(inputs.target.sum(), used, create_graph=create_graph, retain_graph=True)
    batch, length = inputs.ids.shape[0], used[0].shape[-1]
    relevance = torch.eye(length, device=used[0].device, dtype=used[0].dtype).expand(batch, length, length)
    for probs, grad in zip(used, grads):
        weighted = (grad * probs).clamp(min=0).mean(dim=1)  # [B, L, L]
        relevance = relevance + weighted @ relevance
    return _rows_at(relevance, inputs.eos)


def gradient_attribution(inputs: TextAttributionInputs, options: AttributionOptions,
                         create_graph: bool = False) -> Tensor:
    """Sum over embedding dimensions of |dS / d token embedding|."""
    embeddings = inputs.text.embeddings
    if embeddings is None or not embeddings.requires_grad:
        raise ValueError("gradient attribution differentiates the token embeddings: encode the text with grad "
                         "enabled (a frozen text tower needs embeddings that require grad, see "
                         "CLIPEncoders.encode_text_embeddings)")
    (grad,) = torch.autograd.grad(inputs.target.sum(), embeddings, create_graph=create_graph, retain_graph=True)
    return grad.abs().sum(dim=-1)


def word_end_table(tokenizer, vocab_size: int) -> Optional[Tensor]:
    """[vocab] bool from an open_clip SimpleTokenizer (BPE pieces ending in "</w>" end a word), else None."""
    decoder = getattr(tokenizer, "decoder", None)
    if decoder is None:
        return None
    table = torch.ones(vocab_size, dtype=torch.bool)  # unknown ids: each token is its own word
    for token_id, piece in decoder.items():
        if token_id < vocab_size:
            table[token_id] = piece.endswith("</w>")
    return table


def word_groups(ids: Tensor, word_ends: Optional[Tensor]) -> Tensor:
    """[B, L] word index of each content token (0, 1, ...), -1 elsewhere; without a table, one word per token."""
    content = content_mask(ids)
    if word_ends is None:
        ends = content
    else:
        ends = word_ends.to(ids.device)[ids] & content
    # a token starts a new word when it is content and the previous token ended a word (or was not content)
    previous_end = torch.cat([torch.ones_like(ends[:, :1]), ends[:, :-1] | ~content[:, :-1]], dim=1)
    starts = content & previous_end
    index = torch.cumsum(starts.long(), dim=1) - 1
    return torch.where(content, index, torch.full_like(index, -1))


def perturbation_attribution(inputs: TextAttributionInputs, options: AttributionOptions,
                             create_graph: bool = False) -> Tensor:
    """S(I, T) - S(I, T without word w) for every token of word w; all perturbed captions batched."""
    if options.replacement_id >= int(inputs.ids.max()):
        raise ValueError(f"replacement_id {options.replacement_id} would be taken for the EOS token (open_clip "
                         f"pools the largest id); use an ordinary token such as 0 (padding)")
    groups = word_groups(inputs.ids, inputs.word_ends)
    sample, word = _word_pairs(groups)
    length = int(inputs.eos.max()) + 1  # causal tower, EOS pooling: later positions change nothing
    perturbed = inputs.ids[sample, :length].clone()
    perturbed[groups[sample, :length] == word.unsqueeze(1)] = options.replacement_id
    drops = []
    for start in range(0, len(sample), options.chunk_size):
        chunk = slice(start, start + options.chunk_size)
        pooled = inputs.encoders.encode_text(perturbed[chunk]).pooled
        drops.append(inputs.target[sample[chunk]] - pair_similarity(inputs.image[sample[chunk]], pooled))
    drop = torch.cat(drops) if drops else inputs.target.new_zeros(0)
    attribution = inputs.target.new_zeros(inputs.ids.shape)
    token_of_pair = (groups[sample] == word.unsqueeze(1)).to(drop.dtype)  # [pairs, L]
    return attribution.index_add(0, sample, token_of_pair * drop.unsqueeze(1))


def _word_pairs(groups: Tensor) -> tuple[Tensor, Tensor]:
    """(sample, word) index pairs of every word in the batch."""
    counts = groups.amax(dim=1) + 1  # words per caption
    sample = torch.repeat_interleave(torch.arange(len(groups), device=groups.device), counts.clamp(min=0))
    offsets = torch.cumsum(counts.clamp(min=0), dim=0) - counts.clamp(min=0)
    word = torch.arange(len(sample), device=groups.device) - offsets[sample]
    return sample, word


def loosened_attention(q_row: Tensor, k: Tensor, valid: Tensor) -> Tensor:
    """Grad-ECLIP's lambda: cos(q_row, k_i), min-max normalised over the valid positions i (no softmax).

    q_row [..., d], k [..., N, d], valid [..., N] -> [..., N], zero at invalid positions.
    """
    cos = F.cosine_similarity(q_row.unsqueeze(-2), k, dim=-1)
    big = torch.finfo(cos.dtype).max
    low = torch.where(valid, cos, torch.full_like(cos, big)).amin(dim=-1, keepdim=True)
    high = torch.where(valid, cos, torch.full_like(cos, -big)).amax(dim=-1, keepdim=True)
    scaled = (cos - low) / (high - low).clamp(min=1e-12)
    return torch.where(valid, scaled, torch.zeros_like(scaled))


def eclip_layer_map(trace: AttentionTrace, context_grad: Tensor, rows: Tensor, valid: Tensor) -> Tensor:
    """sum_heads sum_d g_d v_{i,d} lambda_i for one block, before any relu; [B, N].

    `context_grad` [B, N, W] is dS/d(context); the channel weights are its row `rows[b]` (EOS or CLS).
    """
    heads, head_dim = trace.q.shape[1], trace.q.shape[-1]
    weights = _rows_at_sequence(context_grad, rows).view(-1, heads, head_dim)  # [B, H, d]
    q_row = _rows_at_sequence(trace.q.transpose(1, 2), rows)  # [B, H, d]
    lam = loosened_attention(q_row, trace.k, valid.unsqueeze(1))  # [B, H, N]
    values = (trace.v * weights.unsqueeze(2)).sum(dim=-1)  # [B, H, N]
    return (values * lam).sum(dim=1)


def _rows_at_sequence(sequence: Tensor, rows: Tensor) -> Tensor:
    """sequence [B, N, ...] -> sequence[b, rows[b]] [B, ...]."""
    return sequence[torch.arange(len(rows), device=rows.device), rows]


def _explained_text_traces(inputs: TextAttributionInputs, options: AttributionOptions
                           ) -> tuple[List[AttentionTrace], Tensor]:
    """The traces of the last `eclip_layers` blocks and the target computed through them."""
    traces = inputs.text.traces
    if traces is None:
        raise ValueError("grad_eclip attribution needs encode_text(..., attn=True)")
    if options.eclip_layers < 1:
        raise ValueError(f"eclip_layers must be at least 1, got {options.eclip_layers}")
    first = len(traces) - min(options.eclip_layers, len(traces))
    if options.heads == "multi":
        return traces[first:], inputs.target
    if options.heads != "single":
        raise ValueError(f"heads must be one of {HEADS}, got {options.heads!r}")
    return _single_head_rerun(inputs, traces[first].block_input, first)


def _single_head_rerun(inputs: TextAttributionInputs, x: Tensor, first: int
                       ) -> tuple[List[AttentionTrace], Tensor]:
    m = inputs.encoders.model
    length = x.shape[1]
    mask = m.attn_mask[:length, :length] if m.attn_mask is not None else None
    traces = []
    for block in m.transformer.resblocks[first:]:
        x, trace = run_block(block, x, mask, heads=1)
        traces.append(trace)
    pooled = inputs.encoders.text_head(x, inputs.ids)
    return traces, pair_similarity(inputs.image, pooled)


def grad_eclip_attribution(inputs: TextAttributionInputs, options: AttributionOptions,
                           create_graph: bool = False) -> Tensor:
    """Grad-ECLIP text map: per-layer EOS-row maps summed over the last blocks, then relu."""
    traces, target = _explained_text_traces(inputs, options)
    grads = torch.autograd.grad(target.sum(), [t.context for t in traces], create_graph=create_graph,
                                retain_graph=True)
    positions = torch.arange(inputs.ids.shape[1], device=inputs.ids.device)
    causal = positions.unsqueeze(0) <= inputs.eos.unsqueeze(1)  # what the EOS row can attend to
    total = sum(eclip_layer_map(trace, grad, inputs.eos, causal) for trace, grad in zip(traces, grads))
    return total.clamp(min=0)


ATTRIBUTIONS: Dict[str, Callable[[TextAttributionInputs, AttributionOptions, bool], Tensor]] = {
    "attention": attention_attribution,
    "gradcam": gradcam_attribution,
    "perturbation": perturbation_attribution,
    "gradient": gradient_attribution,
    "grad_eclip": grad_eclip_attribution,
}


def text_attribution(method: str, inputs: TextAttributionInputs, options: Optional[AttributionOptions] = None,
                     create_graph: bool = False) -> Tensor:
    """Attribution [B, L] of `method` (a key of ATTRIBUTIONS), restricted to the content tokens."""
    if method not in ATTRIBUTIONS:
        raise KeyError(f"unknown attribution method {method!r}; registered: {', '.join(ATTRIBUTIONS)}")
    options = options or AttributionOptions()
    raw = ATTRIBUTIONS[method](inputs, options, create_graph)
    return restrict_and_renormalise(raw, inputs.content, options.renormalise)


def group_means(attribution: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Mean attribution over the tokens in `mask` per caption [B], and whether the caption has any."""
    mask = mask[:, : attribution.shape[1]].to(attribution.dtype)
    count = mask.sum(dim=1)
    return (attribution * mask).sum(dim=1) / count.clamp(min=1), count > 0


def image_grad_eclip(encoders: CLIPEncoders, images: Tensor, text_embeddings: Tensor, heads: str = "multi",
                     create_graph: bool = False) -> Tensor:
    """Grad-ECLIP image heat maps [B, H, W] (upsampled to the input size, each min-max scaled to 0..1).

    Last ViT block; channel weights = dS/d(context) at the CLS row; lambda = min-max over patches of
    cos(q_cls, k_i); map_i = relu(sum_heads sum_d g_d v_{i,d} lambda_i). `heads="single"` re-runs the last
    block with one head (the original code); "multi" explains the model as it is.
    """
    if heads not in HEADS:
        raise ValueError(f"heads must be one of {HEADS}, got {heads!r}")
    # With a frozen vision tower nothing in the forward requires grad; the input pixels give the graph a root.
    features = encoders.encode_image(images if images.requires_grad else images.detach().requires_grad_(True),
                                     attn=True)
    trace = features.traces[-1]
    target_features = features
    if heads == "single":
        x, trace = run_block(encoders.model.visual.transformer.resblocks[-1], trace.block_input, None, heads=1)
        target_features = encoders.image_head(x)
    target = pair_similarity(target_features.pooled, text_embeddings)
    (grad,) = torch.autograd.grad(target.sum(), [trace.context], create_graph=create_graph, retain_graph=True)
    batch, tokens = trace.q.shape[0], trace.q.shape[2]
    cls_rows = torch.zeros(batch, dtype=torch.long, device=images.device)
    patches = torch.arange(tokens, device=images.device) > 0
    maps = eclip_layer_map(trace, grad, cls_rows, patches.expand(batch, tokens))[:, 1:].clamp(min=0)
    grid = encoders.grid_size
    maps = F.interpolate(maps.view(batch, 1, *grid), size=images.shape[-2:], mode="bilinear", align_corners=False)
    return _min_max(maps.squeeze(1))


def _min_max(maps: Tensor) -> Tensor:
    flat = maps.flatten(1)
    low, high = flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True)
    return ((flat - low) / (high - low).clamp(min=1e-12)).view_as(maps)

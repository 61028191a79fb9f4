"""Per-token text attribution and Grad-ECLIP image maps for CLIP (docs/methods.md#attribution-kinds,
docs/methods.md#grad-eclip-explanations).

Plain torch, no Lightning. Every text attribution returns `a` [B, L] for the positive pairs (image b,
caption b), non-zero only on the content tokens 1..EOS-1 (SOT, EOS and padding are never attributed):

- `attention`: attn[EOS, t], averaged (or maxed) over heads and over the chosen layers;
- `gradcam`: Chefer et al.'s relevance: R = I; for each layer from `start_layer`,
  E = mean_heads(relu(dS/dA * A)), R <- R + E R; a_t = R[EOS, t]. `start_layer` 0 aggregates every layer
  (the CAE paper); -1 is the last layer only [ours];
- `perturbation`: the drop S(I, T) - S(I, T'), batched over all perturbed captions T'. With
  `replacement="kind"` (the CAE paper's expected drop when a word is replaced by other concepts) every
  object / attribute / relation word is replaced by K words of its kind (`WordReplacements`, drawn by
  `draw_word_replacements`), spliced in as their own BPE ids (lengths may differ; EOS moves with them), and
  the K drops are averaged; words of no kind get 0. With `replacement="token"` [ours] every word's tokens are
  replaced once by `replacement_id`. Either way the causal text tower runs each perturbed caption only from
  its replaced word to its own EOS, attending to the original caption's keys and values before the word (the
  same numbers as whole forwards up to float rounding, gradients included);
- `gradient`: a_t = sum_d |dS / de_{t,d}| over the token embedding e_t;
- `grad_eclip`: Grad-ECLIP's text map (last `eclip_layers` blocks, EOS row, loosened attention). The
  published map re-runs the explained blocks with one full-width head (`heads="single"`) and min-max scales
  lambda over all context positions, padding included (`text_lambda_range="all_positions"`, which encodes the
  untrimmed text); `heads="multi"` and `"up_to_eos"` are ours.

S(I, T) is the cosine of the L2-normalised image and text embeddings of the pair. The gradient-based
methods take `create_graph=True` during training, so the attribution (and a loss on it) is differentiable
with respect to the weights (double backward). With `renormalise` (default) `a` is divided by its sum (of
absolute values) over the content tokens, which makes a margin between token groups scale-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

# The options are the config schema's `method.attribution` (CLIP-CAE) and `monitor.attribution` sections (fields
# and defaults documented there).
from core.config import AttributionConfig as AttributionOptions
from modeling.encoders import AttentionTrace, CLIPEncoders, TextFeatures, run_block

HEADS = ("multi", "single")
TEXT_LAMBDA_RANGES = ("all_positions", "up_to_eos")
REPLACEMENTS = ("kind", "token")
# Token kind codes (as datamodules/word_vocabulary.py): 0 none, then object, attribute, relation.
OBJECT, ATTRIBUTE, RELATION = 1, 2, 3


def attribution_options(section) -> AttributionOptions:
    """Options from a config section (`method.attribution`, `monitor.attribution`) or any mapping with the same keys."""
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
    replacements: Optional["WordReplacements"] = None  # perturbation with replacement="kind"
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
    """Similarity drop per word: K same-kind replacements averaged ("kind"), or one token ("token")."""
    if options.replacement == "kind":
        return _kind_perturbation(inputs, options)
    if options.replacement == "token":
        return _token_perturbation(inputs, options)
    raise ValueError(f"replacement must be one of {REPLACEMENTS}, got {options.replacement!r}")


def _token_perturbation(inputs: TextAttributionInputs, options: AttributionOptions) -> Tensor:
    """[ours] S(I, T) - S(I, T with word w's tokens all set to `replacement_id`), for every token of w."""
    if options.replacement_id >= int(inputs.ids.max()):
        raise ValueError(f"replacement_id {options.replacement_id} would be taken for the EOS token (open_clip "
                         f"pools the largest id); use an ordinary token such as 0 (padding)")
    groups = word_groups(inputs.ids, inputs.word_ends)
    sample, word = _word_pairs(groups)
    length = int(inputs.eos.max()) + 1  # causal tower, EOS pooling: later positions change nothing
    perturbed = inputs.ids[sample, :length].clone()
    perturbed[groups[sample, :length] == word.unsqueeze(1)] = options.replacement_id
    start = _word_starts(groups, sample, word)
    drop = inputs.target[sample] - _perturbed_similarity(inputs, perturbed, sample, start, options.chunk_size)
    return _spread_over_words(inputs, groups, sample, word, drop)


def _kind_perturbation(inputs: TextAttributionInputs, options: AttributionOptions) -> Tensor:
    """The CAE paper's expected drop: mean over K same-kind replacement words of S(I, T) - S(I, T_k)."""
    replacements = inputs.replacements
    if replacements is None:
        raise ValueError("perturbation with replacement='kind' needs the replacement words (WordReplacements, "
                         "see draw_word_replacements: word kinds from data.masks=true and the training "
                         "captions' vocabulary); replacement='token' needs neither")
    groups = word_groups(inputs.ids, inputs.word_ends)
    count = replacements.lengths.shape[1]
    sample = replacements.sample.repeat_interleave(count)
    word = replacements.word.repeat_interleave(count)
    perturbed = splice_words(inputs.ids, groups, sample, word, replacements.ids.flatten(0, 1),
                             replacements.lengths.flatten(), context_length(inputs.encoders))
    start = _word_starts(groups, sample, word)
    drop = inputs.target[sample] - _perturbed_similarity(inputs, perturbed, sample, start, options.chunk_size)
    mean_drop = drop.view(-1, count).mean(dim=1) if count else drop
    return _spread_over_words(inputs, groups, replacements.sample, replacements.word, mean_drop)


def _word_starts(groups: Tensor, sample: Tensor, word: Tensor) -> Tensor:
    """[P] position of the first token of word `word[p]` of caption `sample[p]`."""
    return (groups[sample] == word.unsqueeze(1)).to(torch.int64).argmax(dim=1)


def _perturbed_similarity(inputs: TextAttributionInputs, perturbed: Tensor, sample: Tensor, start: Tensor,
                          chunk_size: int) -> Tensor:
    """S(I_sample, perturbed caption) for every perturbed caption [P], `chunk_size` captions per forward.

    Caption p equals caption `sample[p]` before position `start[p]`. In a causal tower pooled at EOS (CLIP's)
    the hidden states there are the original caption's, so only positions start[p]..EOS run, attending to the
    original's keys and values (`CLIPEncoders.encode_text_continuations`, which sorts them by that length so
    that each forward pads little; gradients reach the weights through both, as through whole forwards). A
    tower without both properties runs every perturbed caption whole.
    """
    if len(sample) == 0:
        return inputs.target.new_zeros(0)
    encoders = inputs.encoders
    if not encoders.shares_text_prefixes:
        pooled = torch.cat([encoders.encode_text(perturbed[rows]).pooled
                            for rows in torch.arange(len(sample), device=sample.device).split(chunk_size)])
        return pair_similarity(inputs.image[sample], pooled)
    pooled = encoders.encode_text_continuations(perturbed, start, sample, _source_block_inputs(inputs), chunk_size)
    return pair_similarity(inputs.image[sample], pooled)


def _source_block_inputs(inputs: TextAttributionInputs) -> List[Tensor]:
    """The original captions' input to every text block: from their forward when it kept them (`keep_block_inputs`
    or attention traces), else from a new forward of `inputs.ids`."""
    text = inputs.text
    if text.block_inputs is not None and text.block_inputs[0].shape[1] == inputs.ids.shape[1]:
        return text.block_inputs
    return inputs.encoders.encode_text(inputs.ids, keep_block_inputs=True).block_inputs


def _spread_over_words(inputs: TextAttributionInputs, groups: Tensor, sample: Tensor, word: Tensor,
                       value: Tensor) -> Tensor:
    """[B, L] with value[p] at every token of word `word[p]` of caption `sample[p]`, 0 elsewhere."""
    token_of_pair = (groups[sample] == word.unsqueeze(1)).to(value.dtype)  # [pairs, L]
    return inputs.target.new_zeros(inputs.ids.shape).index_add(0, sample, token_of_pair * value.unsqueeze(1))


def context_length(encoders: CLIPEncoders) -> int:
    """Positions of the text tower (77 for CLIP)."""
    return encoders.model.positional_embedding.shape[0]


def splice_words(ids: Tensor, groups: Tensor, sample: Tensor, word: Tensor, replacement: Tensor,
                 lengths: Tensor, max_length: int) -> Tensor:
    """Caption `sample[p]` with its word `word[p]` replaced by `replacement[p, :lengths[p]]`, for every p.

    Args:
        ids: [B, L] token ids (SOT ... EOS, 0-padded); groups: [B, L] `word_groups` of them.
        sample, word: [P] which caption and which of its words; replacement: [P, M] ids, 0-padded;
        lengths: [P] tokens of each replacement (>= 1).
        max_length: the tower's context length; a longer result keeps its first max_length - 1 tokens and ends
            in EOS, as open_clip's tokenizer truncates.

    Returns:
        [P, N] spliced ids, N = the longest result (<= max_length), EOS right after the replacement's tail and
        0-padding after it, so the causal tower pools the new EOS position.
    """
    span = groups[sample] == word.unsqueeze(1)  # [P, L]
    start = span.to(torch.int64).argmax(dim=1)
    removed = span.sum(dim=1)
    eos = eos_positions(ids)[sample]
    new_length = eos + 1 - removed + lengths
    width = min(int(new_length.max()), max_length) if len(sample) else 1
    position = torch.arange(width, device=ids.device).unsqueeze(0)  # [1, N]
    offset = position - start.unsqueeze(1)
    in_replacement = (offset >= 0) & (offset < lengths.unsqueeze(1))
    source = torch.where(offset < 0, position, position - lengths.unsqueeze(1) + removed.unsqueeze(1))
    original = ids[sample].gather(1, source.clamp(0, ids.shape[1] - 1))
    inserted = replacement.gather(1, offset.clamp(0, replacement.shape[1] - 1))
    spliced = torch.where(in_replacement, inserted, original)
    spliced = torch.where(position < new_length.unsqueeze(1), spliced, torch.zeros_like(spliced))
    if width == max_length:  # only then can a result be too long; its last kept position becomes EOS
        spliced[:, -1] = torch.where(new_length > max_length, ids[sample, eos], spliced[:, -1])
    return spliced


@dataclass
class WordReplacements:
    """K replacement words for each perturbed word of a batch (CAE's kind-preserving perturbation)."""

    sample: Tensor  # [W] caption of each perturbed word
    word: Tensor  # [W] its index among the caption's words (`word_groups` numbering)
    ids: Tensor  # [W, K, M] the replacements' BPE ids, 0-padded
    lengths: Tensor  # [W, K] tokens of each replacement


def token_kinds(obj_mask: Tensor, attr_mask: Tensor, rel_mask: Tensor) -> Tensor:
    """[B, L] kind code per token: OBJECT, else RELATION, else ATTRIBUTE, else 0."""
    kinds = torch.zeros(obj_mask.shape, dtype=torch.long, device=obj_mask.device)
    kinds = torch.where(attr_mask.bool(), ATTRIBUTE, kinds)
    kinds = torch.where(rel_mask.bool(), RELATION, kinds)
    return torch.where(obj_mask.bool(), OBJECT, kinds)


_KIND_RANK = {OBJECT: 3, RELATION: 2, ATTRIBUTE: 1, 0: 0}


def draw_word_replacements(ids: Tensor, word_ends: Optional[Tensor], kinds: Tensor, vocabulary, count: int,
                           seeds: Sequence[Sequence[int]]) -> WordReplacements:
    """Draw `count` replacements for every word with a kind, from `vocabulary` (a `WordVocabulary`).

    A word (BPE pieces up to one ending a word) takes the kind of its tokens (object > relation > attribute);
    words without a kind are not perturbed. Caption b draws from `np.random.default_rng(seeds[b])`, its words
    in order, so the draws depend on the caption's seed only (not on the batch, the rank or the device).
    """
    if count < 1:
        raise ValueError(f"num_replacements must be at least 1, got {count}")
    groups = word_groups(ids, word_ends).tolist()
    id_rows, kind_rows = ids.tolist(), kinds[:, : ids.shape[1]].tolist()
    sample, word, drawn = [], [], []
    for b, (group_row, id_row, kind_row) in enumerate(zip(groups, id_rows, kind_rows)):
        rng = np.random.default_rng(list(seeds[b]))
        for index, (tokens, kind) in sorted(_caption_words(group_row, id_row, kind_row).items()):
            if kind:
                sample.append(b)
                word.append(index)
                drawn.append(vocabulary.draw(kind, tokens, rng, count))
    return _pack_replacements(sample, word, drawn, count, ids.device)


def _caption_words(group_row: List[int], id_row: List[int], kind_row: List[int]
                   ) -> Dict[int, Tuple[Tuple[int, ...], int]]:
    """Word index -> (its token ids, its kind: the highest-ranked kind of its tokens, 0 for none)."""
    tokens: Dict[int, List[int]] = {}
    kinds: Dict[int, int] = {}
    for group, token, kind in zip(group_row, id_row, kind_row):
        if group >= 0:
            tokens.setdefault(group, []).append(token)
            kinds[group] = max(kinds.get(group, 0), kind, key=_KIND_RANK.__getitem__)
    return {group: (tuple(tokens[group]), kinds[group]) for group in tokens}


def _pack_replacements(sample: List[int], word: List[int], drawn: List[List[Tuple[int, ...]]], count: int,
                       device: torch.device) -> WordReplacements:
    width = max((len(tokens) for words in drawn for tokens in words), default=1)
    ids = torch.zeros(len(drawn), count, width, dtype=torch.long)
    lengths = torch.zeros(len(drawn), count, dtype=torch.long)
    for row, words in enumerate(drawn):
        for k, tokens in enumerate(words):
            ids[row, k, : len(tokens)] = torch.tensor(tokens)
            lengths[row, k] = len(tokens)
    return WordReplacements(torch.tensor(sample, dtype=torch.long, device=device),
                            torch.tensor(word, dtype=torch.long, device=device), ids.to(device), lengths.to(device))


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
    """Grad-ECLIP text map: per-layer EOS-row maps summed over the last blocks, then relu.

    lambda is min-max scaled over every context position, padding included ("all_positions", the original
    code), or over the positions 0..EOS that the EOS row attends to ("up_to_eos", ours). The first needs the
    padding positions' keys: a text trimmed after its last EOS is encoded again at full length.
    """
    if options.text_lambda_range not in TEXT_LAMBDA_RANGES:
        raise ValueError(f"text_lambda_range must be one of {TEXT_LAMBDA_RANGES}, got {options.text_lambda_range!r}")
    length = inputs.ids.shape[1]
    if options.text_lambda_range == "all_positions":
        inputs = untrimmed(inputs)
    traces, target = _explained_text_traces(inputs, options)
    grads = torch.autograd.grad(target.sum(), [t.context for t in traces], create_graph=create_graph,
                                retain_graph=True)
    positions = torch.arange(inputs.ids.shape[1], device=inputs.ids.device)
    if options.text_lambda_range == "all_positions":
        valid = torch.ones(inputs.ids.shape, dtype=torch.bool, device=inputs.ids.device)
    else:
        valid = positions.unsqueeze(0) <= inputs.eos.unsqueeze(1)  # what the EOS row can attend to
    total = sum(eclip_layer_map(trace, grad, inputs.eos, valid) for trace, grad in zip(traces, grads))
    return total.clamp(min=0)[:, :length]


def untrimmed(inputs: TextAttributionInputs) -> TextAttributionInputs:
    """The inputs at the tower's full context length: a text cut after its last EOS is encoded again, with
    0-padding (open_clip's), from the same token embeddings (so their graph, and a frozen tower's leaf, stay)."""
    encoders, ids = inputs.encoders, inputs.ids
    missing = context_length(encoders) - ids.shape[1]
    if missing <= 0:
        return inputs
    if inputs.text.embeddings is None:
        raise ValueError("re-encoding a trimmed text needs its token embeddings (TextFeatures.embeddings)")
    padding = ids.new_zeros(ids.shape[0], missing)
    pad_embeddings = encoders.model.token_embedding(padding).to(inputs.text.embeddings.dtype)
    full_ids = torch.cat([ids, padding], dim=1)
    text = encoders.encode_text_embeddings(torch.cat([inputs.text.embeddings, pad_embeddings], dim=1), full_ids,
                                           attn=True)
    return TextAttributionInputs(encoders, full_ids, inputs.image, text, inputs.word_ends, inputs.replacements)


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


def image_grad_eclip_grid(encoders: CLIPEncoders, images: Tensor, text_embeddings: Tensor, heads: str = "single",
                          create_graph: bool = False) -> Tuple[Tensor, Tensor]:
    """Grad-ECLIP image maps on the patch grid, before any scaling, and the explained cosine.

    Last ViT block; channel weights g = dc/d(context) at the CLS row; lambda = min-max over the patches of
    cos(q_cls, k_i) (q, k with their bias, before the 1/sqrt(d) scaling); map_i = relu(sum_heads sum_d g_d v_{i,d}
    lambda_i), in row-major grid order. `heads="single"` re-runs the last block with one full-width head and
    explains the cosine of that re-run's embedding (the original code, the published map); "multi" [ours]
    explains the model as it is. Images of any size (multiples of the patch size), square or not, run on their
    own patch grid with the positional embeddings resized to it, as the original explains aspect-preserving
    inputs (`CLIPEncoders.image_positions`); at the model's size nothing is resized.

    Returns:
        maps [B, grid_h, grid_w] (relu'd, unscaled) of the images' patch grid and the explained cosine c [B].
    """
    if heads not in HEADS:
        raise ValueError(f"heads must be one of {HEADS}, got {heads!r}")
    # With a frozen vision tower nothing in the forward requires grad; the input pixels give the graph a root.
    features = encoders.encode_image(images if images.requires_grad else images.detach().requires_grad_(True),
                                     attn=True, resize_positions=True)
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
    return maps.view(batch, *features.grid_size), target


def image_grad_eclip(encoders: CLIPEncoders, images: Tensor, text_embeddings: Tensor, heads: str = "single",
                     create_graph: bool = False) -> Tensor:
    """Grad-ECLIP image heat maps [B, H, W] at the input size (square or not), in 0..1.

    The original's order: each grid map min-max scaled to 0..1, then resized to the image bilinearly (the
    resize of a min-max scaled map may peak below 1). See `image_grad_eclip_grid` for the map and `heads`.
    """
    grid, _ = image_grad_eclip_grid(encoders, images, text_embeddings, heads, create_graph)
    scaled = min_max(grid).unsqueeze(1)
    return F.interpolate(scaled, size=images.shape[-2:], mode="bilinear", align_corners=False).squeeze(1)


def min_max(maps: Tensor) -> Tensor:
    """Each map [B, ...] scaled to 0..1 (an all-equal map becomes 0)."""
    flat = maps.flatten(1)
    low, high = flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True)
    return ((flat - low) / (high - low).clamp(min=1e-12)).view_as(maps)

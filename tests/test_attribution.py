"""Text attributions and Grad-ECLIP image maps against slow references (docs/methods.md#attribution-kinds,
docs/methods.md#grad-eclip-explanations).

The references run one caption (or image) at a time and recompute every attention head by hand from the
blocks' `in_proj_weight` slices, with explicit Python loops over layers, heads, positions and words. They
never call the library's helpers (`CLIPEncoders`, `run_block`, `eclip_layer_map`, ...); the perturbation
reference calls open_clip's own `model.encode_text`.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from collections import Counter

from modeling.encoders import CLIPEncoders, build_model
from datamodules.word_vocabulary import ATTRIBUTE, OBJECT, RELATION, WordVocabulary
from modeling.attribution import (
                                                   ATTRIBUTIONS,
                                                   AttributionOptions,
                                                   TextAttributionInputs,
                                                   attribution_options,
                                                   draw_word_replacements,
                                                   group_means,
                                                   image_grad_eclip,
                                                   image_grad_eclip_grid,
                                                   splice_words,
                                                   text_attribution,
                                                   token_kinds,
                                                   word_end_table,
                                                   word_groups,
                                                   )
from tolerance import assert_scaled_close, scaled_close

# "axolotl" and "photosynthesizing" are split into several BPE pieces; "" has no content token at all.
CAPTIONS = ["a red-haired axolotl swims", "two dogs left of a cat", "", "a photosynthesizing fern"]
EMPTY = 2
# Word kinds of the captions' words (as the scene-graph parser would give them); "-" and "a" have none.
WORD_KINDS = {"red": ATTRIBUTE, "haired": ATTRIBUTE, "axolotl": OBJECT, "swims": RELATION, "two": ATTRIBUTE,
              "dogs": OBJECT, "left": RELATION, "of": RELATION, "cat": OBJECT, "photosynthesizing": ATTRIBUTE,
              "fern": OBJECT}
# Replacement words with their training counts: several of them are the captions' own words (never drawn for
# themselves), some have several BPE tokens ("traffic light", "photosynthesizing").
VOCABULARY_COUNTS = {OBJECT: Counter({"cat": 3, "dogs": 1, "fern": 2, "axolotl": 1, "tree": 5, "traffic light": 2}),
                     ATTRIBUTE: Counter({"red": 4, "two": 2, "fluffy": 1, "photosynthesizing": 1}),
                     RELATION: Counter({"left": 2, "of": 3, "on": 5, "swims": 1, "next to": 2})}
K = 3
# The library runs batched, fused float32 kernels; the references loop per caption and per head, so the two
# round differently: ~1e-6 of the largest value after the 2-block tower's forward and backward passes (1.6e-6
# at most on 1 and 2 threads; the min-max normalisations of Grad-ECLIP amplify it by max / (max - min)).
RTOL = 2e-5


def assert_close(actual: Tensor, expected: Tensor, rtol: float = RTOL) -> None:
    """rtol of each value and of the tensor's largest one: attributions near 0 (relu boundaries, small drops)
    are sums of terms of the largest value's size (values reach ~30 for the gradient norm)."""
    assert_scaled_close(actual, expected, rtol)


@pytest.fixture(scope="module")
def ctx() -> SimpleNamespace:
    """The seeded tiny CLIP, the captions' ids, random images and the L2-normalised pair embeddings."""
    torch.manual_seed(0)
    built = build_model("ViT-Tiny-16-64", None, "configs/models")
    model = built.model.eval()
    ids = built.tokenizer(CAPTIONS)
    size = model.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    images = torch.randn(len(CAPTIONS), 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        image = F.normalize(model.encode_image(images), dim=-1)
        text = F.normalize(model.encode_text(ids), dim=-1)
    ctx = SimpleNamespace(model=model, encoders=CLIPEncoders(model), tokenizer=built.tokenizer, ids=ids,
                          images=images, image=image, text=text, eot=built.tokenizer.eot_token_id,
                          word_ends=word_end_table(built.tokenizer, model.vocab_size),
                          vocabulary=WordVocabulary.from_counts(VOCABULARY_COUNTS, built.tokenizer))
    ctx.kinds = hand_token_kinds(ctx)
    ctx.replacements = draw_word_replacements(ids, ctx.word_ends, ctx.kinds, ctx.vocabulary, K,
                                              [(0, b) for b in range(len(CAPTIONS))])
    return ctx


def word_text(ctx: SimpleNamespace, ids_row: Tensor, word: List[int]) -> str:
    return "".join(ctx.tokenizer.decoder[int(ids_row[t])] for t in word).replace("</w>", "")


def hand_token_kinds(ctx: SimpleNamespace) -> Tensor:
    """[B, L] kinds of WORD_KINDS; only the first piece of "axolotl" is marked (a word takes its tokens' kind)."""
    kinds = torch.zeros(ctx.ids.shape, dtype=torch.long)
    for b, ids_row in enumerate(ctx.ids):
        for word in reference_words(ctx, ids_row):
            text = word_text(ctx, ids_row, word)
            kinds[b, word[:1] if text == "axolotl" else word] = WORD_KINDS.get(text, 0)
    return kinds


def attribution_inputs(ctx: SimpleNamespace, with_words: bool = True, ids: Optional[Tensor] = None
                       ) -> TextAttributionInputs:
    """A fresh traced text forward of the batch (each test gets its own autograd graph)."""
    ids = ctx.ids if ids is None else ids
    text = ctx.encoders.encode_text(ids, attn=True)
    return TextAttributionInputs(ctx.encoders, ids, ctx.image, text, ctx.word_ends if with_words else None,
                                 ctx.replacements)


# ----------------------------------------------------------------------------------------------------------
# Naive forward passes: one sequence, one head at a time
# ----------------------------------------------------------------------------------------------------------


@dataclass
class BlockRecord:
    """What one block's attention computed, per head (before any scaling of q)."""

    probs: List[Tensor]  # per head [N, N]
    q: List[Tensor]  # per head [N, d]
    k: List[Tensor]
    v: List[Tensor]
    context: Tensor  # [N, W], heads concatenated, before out_proj


def projection_rows(tensor: Tensor, part: int, head: int, head_dim: int, width: int) -> Tensor:
    """Rows of in_proj_weight / in_proj_bias for q (part 0), k (1) or v (2) of one head."""
    start = part * width + head * head_dim
    return tensor[start:start + head_dim]


def naive_block(block, x: Tensor, mask: Tensor | float, heads: int) -> tuple[Tensor, BlockRecord]:
    """One pre-LN residual block on x [N, W], attention recomputed head by head (layer scale is identity)."""
    width = x.shape[-1]
    head_dim = width // heads
    h = block.ln_1(x)
    weight, bias = block.attn.in_proj_weight, block.attn.in_proj_bias
    record = BlockRecord([], [], [], [], torch.empty(0))
    for head in range(heads):
        q, k, v = (h @ projection_rows(weight, part, head, head_dim, width).T
                   + projection_rows(bias, part, head, head_dim, width) for part in range(3))
        probs = torch.softmax(q @ k.T / math.sqrt(head_dim) + mask, dim=-1)
        for store, value in ((record.probs, probs), (record.q, q), (record.k, k), (record.v, v)):
            store.append(value)
    record.context = torch.cat([p @ v for p, v in zip(record.probs, record.v)], dim=-1)
    x = x + record.context @ block.attn.out_proj.weight.T + block.attn.out_proj.bias
    x = x + block.mlp(block.ln_2(x))
    return x, record


def causal_mask(length: int) -> Tensor:
    return torch.full((length, length), float("-inf")).triu(1)


def eos_of(ctx: SimpleNamespace, ids_row: Tensor) -> int:
    """The first position of the end-of-text token."""
    return next(t for t, token in enumerate(ids_row.tolist()) if token == ctx.eot)


def naive_text_head(model, x: Tensor, eos: int) -> Tensor:
    return model.ln_final(x[eos]) @ model.text_projection


def cosine(a: Tensor, b: Tensor) -> Tensor:
    return torch.dot(a, b) / (a.norm() * b.norm())


@dataclass
class NaiveText:
    embeddings: Tensor  # [L, W], a leaf that requires grad
    block_inputs: List[Tensor]
    blocks: List[BlockRecord]
    pooled: Tensor  # [D]
    eos: int


def naive_text(ctx: SimpleNamespace, b: int) -> NaiveText:
    """Caption b through the text tower at full context length, every head by hand."""
    model, ids_row = ctx.model, ctx.ids[b]
    embeddings = model.token_embedding.weight[ids_row].detach().requires_grad_(True)
    x = embeddings + model.positional_embedding[: len(ids_row)]
    block_inputs, records = [], []
    for block in model.transformer.resblocks:
        block_inputs.append(x)
        x, record = naive_block(block, x, causal_mask(len(ids_row)), block.attn.num_heads)
        records.append(record)
    eos = eos_of(ctx, ids_row)
    return NaiveText(embeddings, block_inputs, records, naive_text_head(model, x, eos), eos)


def test_naive_tower_is_open_clip(ctx):
    """The references below stand on this forward: it must be open_clip's text tower."""
    with torch.no_grad():
        expected = ctx.model.encode_text(ctx.ids)
    for b in range(len(CAPTIONS)):
        assert_close(naive_text(ctx, b).pooled.detach(), expected[b])


# ----------------------------------------------------------------------------------------------------------
# Reference attributions: raw [L] per caption, before the restriction to content tokens
# ----------------------------------------------------------------------------------------------------------


def reference_attention(ctx, b: int, options: AttributionOptions) -> Tensor:
    with torch.no_grad():
        naive = naive_text(ctx, b)
    count = len(naive.blocks)
    layers = range(count) if options.layers is None else [layer % count for layer in options.layers]
    length = len(ctx.ids[b])
    total = torch.zeros(length)
    for layer in layers:
        for t in range(length):
            per_head = [probs[naive.eos, t] for probs in naive.blocks[layer].probs]
            total[t] += max(per_head) if options.head_reduce == "max" else sum(per_head) / len(per_head)
    return total / len(layers)


def reference_gradcam(ctx, b: int, options: AttributionOptions) -> Tensor:
    naive = naive_text(ctx, b)
    target = cosine(ctx.image[b], naive.pooled)
    relevance = torch.eye(len(ctx.ids[b]))
    for record in naive.blocks[options.start_layer % len(naive.blocks):]:
        grads = torch.autograd.grad(target, record.probs, retain_graph=True)
        heads = [(grad * probs).clamp(min=0) for grad, probs in zip(grads, record.probs)]
        relevance = relevance + (sum(heads) / len(heads)) @ relevance
    return relevance[naive.eos].detach()


def reference_gradient(ctx, b: int, options: AttributionOptions) -> Tensor:
    naive = naive_text(ctx, b)
    (grad,) = torch.autograd.grad(cosine(ctx.image[b], naive.pooled), [naive.embeddings])
    return torch.stack([grad[t].abs().sum() for t in range(len(grad))])


def reference_words(ctx, ids_row: Tensor, by_word: bool = True) -> List[List[int]]:
    """Content positions grouped into words: BPE pieces up to one ending in "</w>" (or one word per token)."""
    words, current = [], []
    for t in range(1, eos_of(ctx, ids_row)):
        current.append(t)
        if not by_word or ctx.tokenizer.decoder[int(ids_row[t])].endswith("</w>"):
            words.append(current)
            current = []
    return words + ([current] if current else [])


def reference_perturbation(ctx, b: int, options: AttributionOptions, by_word: bool = True) -> Tensor:
    """Replace each word by hand in the full-length ids and ask open_clip's encode_text."""
    if options.replacement == "kind":
        return reference_kind_perturbation(ctx, b)
    ids_row = ctx.ids[b]
    raw = torch.zeros(len(ids_row))
    with torch.no_grad():
        base = cosine(ctx.image[b], ctx.model.encode_text(ids_row[None])[0])
        for word in reference_words(ctx, ids_row, by_word):
            perturbed = ids_row.clone()
            for t in word:
                perturbed[t] = options.replacement_id
            drop = base - cosine(ctx.image[b], ctx.model.encode_text(perturbed[None])[0])
            for t in word:
                raw[t] = drop
    return raw


def reference_kind_perturbation(ctx, b: int) -> Tensor:
    """Every typed word of caption b replaced by each of its K drawn words, spliced into the token list by hand
    (Python lists, 0-padded to the context length); drops from open_clip's encode_text, averaged over K."""
    ids_row = ctx.ids[b]
    tokens = ids_row[: eos_of(ctx, ids_row) + 1].tolist()
    words = reference_words(ctx, ids_row)
    reps = ctx.replacements
    raw = torch.zeros(len(ids_row))
    with torch.no_grad():
        base = cosine(ctx.image[b], ctx.model.encode_text(ids_row[None])[0])
        for p in [p for p in range(len(reps.sample)) if int(reps.sample[p]) == b]:
            word = words[int(reps.word[p])]
            drops = []
            for k in range(K):
                new = tokens[:word[0]] + reps.ids[p, k, : int(reps.lengths[p, k])].tolist() + tokens[word[-1] + 1:]
                padded = torch.tensor(new + [0] * (len(ids_row) - len(new)))
                drops.append(base - cosine(ctx.image[b], ctx.model.encode_text(padded[None])[0]))
            for t in word:
                raw[t] = sum(drops) / len(drops)
    return raw


def min_max_cosines(query: Tensor, keys: Sequence[Tensor]) -> Tensor:
    """Grad-ECLIP's loosened attention: cos(q, k_i) min-max scaled over the given keys."""
    cos = torch.stack([F.cosine_similarity(query, key, dim=0) for key in keys])
    return (cos - cos.min()) / (cos.max() - cos.min())


def eclip_map(records: List[BlockRecord], grads: Sequence[Tensor], row: int, positions: List[int],
              length: int) -> Tensor:
    """sum_layers sum_heads sum_d g_d v_{i,d} lambda_i at `positions`, relu; zero elsewhere."""
    total = torch.zeros(length)
    for record, grad in zip(records, grads):
        head_dim = record.q[0].shape[-1]
        for head in range(len(record.q)):
            channel_weights = grad[row, head * head_dim:(head + 1) * head_dim]
            lam = min_max_cosines(record.q[head][row], [record.k[head][i] for i in positions])
            for lam_i, i in zip(lam, positions):
                total[i] += (channel_weights * record.v[head][i]).sum() * lam_i
    return total.clamp(min=0).detach()


def reference_grad_eclip(ctx, b: int, options: AttributionOptions) -> Tensor:
    naive = naive_text(ctx, b)
    first = len(naive.blocks) - min(options.eclip_layers, len(naive.blocks))
    if options.heads == "multi":
        records, pooled = naive.blocks[first:], naive.pooled
    else:  # the paper's re-run: the explained blocks with one full-width head, from the first one's input
        x, records = naive.block_inputs[first], []
        for block in ctx.model.transformer.resblocks[first:]:
            x, record = naive_block(block, x, causal_mask(len(x)), heads=1)
            records.append(record)
        pooled = naive_text_head(ctx.model, x, naive.eos)
    grads = torch.autograd.grad(cosine(ctx.image[b], pooled), [record.context for record in records])
    # lambda's min-max range: every context position (the original code), or 0..EOS (ours)
    last = len(ctx.ids[b]) - 1 if options.text_lambda_range == "all_positions" else naive.eos
    return eclip_map(records, grads, naive.eos, list(range(last + 1)), len(ctx.ids[b]))


REFERENCES: Dict[str, Callable[..., Tensor]] = {
    "attention": reference_attention,
    "gradcam": reference_gradcam,
    "perturbation": reference_perturbation,
    "gradient": reference_gradient,
    "grad_eclip": reference_grad_eclip,
}


def restrict_reference(raw: Tensor, eos: int, renormalise: bool) -> Tensor:
    """Keep positions 1..EOS-1; optionally divide by their sum of absolute values."""
    out = torch.zeros_like(raw)
    for t in range(1, eos):
        out[t] = raw[t]
    total = out.abs().sum()
    return out / total if renormalise and total > 0 else out


def reference_batch(ctx, method: str, options: AttributionOptions, **kwargs) -> Tensor:
    """The raw reference of every caption, restricted to its content tokens, not normalised."""
    rows = [REFERENCES[method](ctx, b, options, **kwargs) for b in range(len(CAPTIONS))]
    return torch.stack([restrict_reference(row, eos_of(ctx, ids), False) for row, ids in zip(rows, ctx.ids)])


def renormalised(ctx, raw: Tensor) -> Tensor:
    return torch.stack([restrict_reference(row, eos_of(ctx, ids), True) for row, ids in zip(raw, ctx.ids)])


# ----------------------------------------------------------------------------------------------------------
# Library against references
# ----------------------------------------------------------------------------------------------------------

TOKEN = AttributionOptions(replacement="token")  # [ours] one replacement token per word

CASES = [
    ("attention", AttributionOptions()),
    ("attention", AttributionOptions(layers=[1])),
    ("attention", AttributionOptions(layers=[-1, 0], head_reduce="max")),
    ("gradcam", AttributionOptions()),  # start_layer 0: every layer (the CAE paper)
    ("gradcam", AttributionOptions(start_layer=-1)),
    ("perturbation", AttributionOptions()),  # the CAE paper's: K words of the same kind
    ("perturbation", AttributionOptions(chunk_size=2)),
    ("perturbation", TOKEN),
    ("perturbation", replace(TOKEN, chunk_size=1)),
    ("perturbation", replace(TOKEN, replacement_id=320, chunk_size=3)),  # "a</w>" as the mask token
    ("gradient", AttributionOptions()),
    ("grad_eclip", AttributionOptions()),  # the published map; eclip_layers 8 > 2 blocks: every block
    ("grad_eclip", AttributionOptions(eclip_layers=1)),
    ("grad_eclip", AttributionOptions(text_lambda_range="up_to_eos")),
    ("grad_eclip", AttributionOptions(heads="multi")),
    ("grad_eclip", AttributionOptions(heads="multi", text_lambda_range="up_to_eos")),
    ("grad_eclip", AttributionOptions(heads="multi", text_lambda_range="up_to_eos", eclip_layers=1)),
]
CASE_IDS = [f"{method}-{i}" for i, (method, _) in enumerate(CASES)]


def test_captions_cover_the_edge_cases(ctx):
    """The premise of the word-level checks: a word of several BPE pieces, and an empty caption."""
    word_sizes = [len(word) for ids in ctx.ids for word in reference_words(ctx, ids)]
    assert max(word_sizes) >= 3
    assert eos_of(ctx, ctx.ids[EMPTY]) == 1


@pytest.mark.parametrize("method, options", CASES, ids=CASE_IDS)
def test_matches_reference(ctx, method, options):
    expected_raw = reference_batch(ctx, method, options)
    assert (expected_raw.abs().sum(dim=1) > 0).sum() >= 2  # a non-trivial comparison
    raw = text_attribution(method, attribution_inputs(ctx), replace(options, renormalise=False))
    assert_close(raw.detach(), expected_raw)
    normalised = text_attribution(method, attribution_inputs(ctx), replace(options, renormalise=True))
    assert_close(normalised.detach(), renormalised(ctx, expected_raw))


def test_perturbation_without_word_table_replaces_single_tokens(ctx):
    options = replace(TOKEN, renormalise=False)
    expected = reference_batch(ctx, "perturbation", options, by_word=False)
    got = text_attribution("perturbation", attribution_inputs(ctx, with_words=False), options)
    assert_close(got, expected)
    # the multi-piece word gives different drops per piece once pieces are replaced one at a time
    assert not scaled_close(expected, reference_batch(ctx, "perturbation", options), 1e-3)  # far beyond rounding


def test_perturbation_chunking_does_not_change_the_result(ctx):
    whole = text_attribution("perturbation", attribution_inputs(ctx), replace(TOKEN, renormalise=False))
    one_by_one = text_attribution("perturbation", attribution_inputs(ctx),
                                  replace(TOKEN, chunk_size=1, renormalise=False))
    # one caption per forward against the whole batch: other matmul shapes, so not bit-identical (they differ
    # on 2 threads, not on 1); the drops are differences of cosines, rounded like the cosines
    assert_close(one_by_one, whole)


def perturbation_and_gradients(ctx, options: AttributionOptions):
    """The perturbation attribution from the training forward (no traces) and its weighted sum's gradients."""
    text = ctx.encoders.encode_text(ctx.ids, keep_block_inputs=True)
    inputs = TextAttributionInputs(ctx.encoders, ctx.ids, ctx.image, text, ctx.word_ends, ctx.replacements)
    attribution = text_attribution("perturbation", inputs, replace(options, renormalise=False))
    weights = torch.linspace(-1, 1, attribution.numel()).view_as(attribution)
    parameters = [p for name, p in ctx.model.named_parameters() if not name.startswith("visual.")]
    return attribution.detach(), torch.autograd.grad((attribution * weights).sum(), parameters, allow_unused=True)


def spy(monkeypatch, name: str, record: Callable[..., None]) -> None:
    """Let `record(ids, *args)` see every call of CLIPEncoders.<name> (which then runs as usual)."""
    method = getattr(CLIPEncoders, name)

    def recorded(self, ids, *args, **kwargs):
        record(ids, *args)
        return method(self, ids, *args, **kwargs)
    monkeypatch.setattr(CLIPEncoders, name, recorded)


@pytest.mark.parametrize("options", [AttributionOptions(), TOKEN], ids=["kind", "token"])
def test_perturbation_runs_each_caption_from_its_replaced_word_only(ctx, options, monkeypatch):
    """The text tower is causal: before the replaced word a perturbed caption's hidden states are the original's.
    Only the positions from the word to the new EOS run (no whole forward of a perturbed caption); the values
    (see test_matches_reference) and the gradients that reach the text weights are those of whole forwards."""
    continued, whole_forwards = [], []
    spy(monkeypatch, "encode_text_continuations",
        lambda ids, start, *rest: continued.append(int((ids.argmax(dim=-1) - start + 1).sum())))
    spy(monkeypatch, "encode_text", lambda ids, *rest: whole_forwards.append(ids.shape))
    shared, shared_grads = perturbation_and_gradients(ctx, options)
    assert len(whole_forwards) == 1 and continued  # the original captions' own forward, then continuations
    monkeypatch.setattr(CLIPEncoders, "shares_text_prefixes", property(lambda self: False))
    whole, whole_grads = perturbation_and_gradients(ctx, options)
    perturbed_rows = sum(int(shape[0] * shape[1]) for shape in whole_forwards[2:])
    assert sum(continued) < 0.7 * perturbed_rows  # the words' prefixes do not run again
    assert_close(shared, whole)
    for a, b in zip(shared_grads, whole_grads):
        assert (a is None) == (b is None)
        assert a is None or scaled_close(a, b, 1e-5)


@pytest.mark.parametrize("renormalise", [True, False])
@pytest.mark.parametrize("method", list(ATTRIBUTIONS))
def test_zero_outside_content_and_unit_mass(ctx, method, renormalise):
    got = text_attribution(method, attribution_inputs(ctx), AttributionOptions(renormalise=renormalise)).detach()
    for b, ids in enumerate(ctx.ids):
        eos = eos_of(ctx, ids)
        outside = [t for t in range(len(ids)) if not 1 <= t < eos]
        assert torch.all(got[b, outside] == 0), f"{method}: caption {b} attributes SOT/EOS/padding"
        if b == EMPTY:
            assert torch.all(got[b] == 0)
        elif renormalise:
            assert got[b, 1:eos].abs().sum().item() == pytest.approx(1.0, rel=1e-5)  # <= 77 float32 terms


def test_kind_replacements_are_words_of_the_same_kind_never_the_word_itself(ctx):
    reps, typed = ctx.replacements, []
    for b, ids_row in enumerate(ctx.ids):
        typed += [(b, w, word) for w, word in enumerate(reference_words(ctx, ids_row))
                  if word_text(ctx, ids_row, word) in WORD_KINDS]
    assert [(int(b), int(w)) for b, w in zip(reps.sample, reps.word)] == [(b, w) for b, w, _ in typed]
    for p, (b, _, word) in enumerate(typed):
        kind = WORD_KINDS[word_text(ctx, ctx.ids[b], word)]
        original = tuple(ctx.ids[b, word].tolist())
        for k in range(K):
            drawn = tuple(reps.ids[p, k, : int(reps.lengths[p, k])].tolist())
            assert drawn in ctx.vocabulary.tables[kind].index and drawn != original
    assert int(reps.lengths.max()) >= 2  # a multi-token replacement is among them: the splice changes lengths


def test_kind_perturbation_leaves_words_without_a_kind_at_zero(ctx):
    raw = text_attribution("perturbation", attribution_inputs(ctx), AttributionOptions(renormalise=False))
    for b, ids_row in enumerate(ctx.ids):
        for word in reference_words(ctx, ids_row):
            typed = word_text(ctx, ids_row, word) in WORD_KINDS
            assert bool((raw[b, word] != 0).all()) == typed, word_text(ctx, ids_row, word)


def test_kind_perturbation_without_replacements_names_them(ctx):
    inputs = replace(attribution_inputs(ctx), replacements=None)
    with pytest.raises(ValueError, match="replacement words"):
        text_attribution("perturbation", inputs)


def test_draws_depend_on_the_caption_seed_only(ctx):
    alone = draw_word_replacements(ctx.ids[1:2], ctx.word_ends, ctx.kinds[1:2], ctx.vocabulary, K, [(0, 1)])
    in_batch = ctx.replacements.sample == 1
    assert torch.equal(alone.ids, ctx.replacements.ids[in_batch])
    other = draw_word_replacements(ctx.ids[1:2], ctx.word_ends, ctx.kinds[1:2], ctx.vocabulary, K, [(1, 1)])
    assert not torch.equal(other.ids, alone.ids)


def test_splice_words_on_a_hand_built_batch():
    table = word_end_table(SimpleNamespace(decoder=TOY_DECODER), vocab_size=10)
    ids = torch.tensor([[SOT, 4, 1, 2, 3, 4, EOT, 0, 0, 0]])
    groups = word_groups(ids, table)  # words: [4], [1, 2, 3], [4]
    sample, word = torch.tensor([0, 0, 0]), torch.tensor([1, 0, 2])
    replacement = torch.tensor([[12, 0, 0], [1, 2, 3], [4, 12, 4]])
    lengths = torch.tensor([1, 3, 3])
    assert splice_words(ids, groups, sample, word, replacement, lengths, 10).tolist() == [
        [SOT, 4, 12, 4, EOT, 0, 0, 0, 0],  # shorter: EOS moves left, padding after it
        [SOT, 1, 2, 3, 1, 2, 3, 4, EOT],  # longer
        [SOT, 4, 1, 2, 3, 4, 12, 4, EOT]]
    # beyond the context length: the first max_length - 1 tokens and EOS, as the tokenizer truncates
    assert splice_words(ids, groups, sample[1:2], word[1:2], replacement[1:2], lengths[1:2], 7).tolist() == [
        [SOT, 1, 2, 3, 1, 2, EOT]]


def test_token_kinds_rank_object_over_relation_over_attribute():
    obj = torch.tensor([[0, 1, 1, 0, 0]], dtype=torch.bool)
    attr = torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.bool)
    rel = torch.tensor([[0, 1, 0, 0, 1]], dtype=torch.bool)
    assert token_kinds(obj, attr, rel).tolist() == [[0, OBJECT, OBJECT, ATTRIBUTE, RELATION]]


@pytest.mark.parametrize("heads", ["single", "multi"])
def test_all_positions_lambda_re_encodes_a_trimmed_text(ctx, heads):
    """The official lambda range needs the padding positions' keys: a trimmed text gives the untrimmed map."""
    options = AttributionOptions(heads=heads, renormalise=False)
    length = max(eos_of(ctx, ids) for ids in ctx.ids) + 1
    trimmed = text_attribution("grad_eclip", attribution_inputs(ctx, ids=ctx.ids[:, :length]), options)
    full = text_attribution("grad_eclip", attribution_inputs(ctx), options)
    assert trimmed.shape == (len(CAPTIONS), length)
    assert_close(trimmed.detach(), full[:, :length].detach())
    up_to_eos = text_attribution("grad_eclip", attribution_inputs(ctx), replace(options, text_lambda_range="up_to_eos"))
    assert not scaled_close(up_to_eos, full, 1e-3)  # the two ranges differ far beyond rounding


# ----------------------------------------------------------------------------------------------------------
# Training-time: a loss on the attribution reaches the text encoder's weights
# ----------------------------------------------------------------------------------------------------------


def position_weights(ctx) -> Tensor:
    """[B, L] weight t at position t: the loss is the attribution's mean position, which moves with the
    weights (a plain content sum would be constant under renormalisation, and one token may sit at relu's 0)."""
    return torch.arange(ctx.ids.shape[1], dtype=torch.float32).expand(ctx.ids.shape)


def attribution_loss_grads(ctx, method: str, create_graph: bool) -> List[Optional[Tensor]]:
    weights = [ctx.model.transformer.resblocks[-1].attn.in_proj_weight, ctx.model.token_embedding.weight]
    a = text_attribution(method, attribution_inputs(ctx), AttributionOptions(), create_graph=create_graph)
    if not a.requires_grad:
        return [None, None]
    loss = (a * position_weights(ctx)).sum()
    return list(torch.autograd.grad(loss, weights, allow_unused=True))


@pytest.mark.parametrize("method", list(ATTRIBUTIONS))
def test_attribution_loss_reaches_text_weights(ctx, method):
    for name, grad in zip(["in_proj_weight", "token_embedding"], attribution_loss_grads(ctx, method, True)):
        assert grad is not None and grad.abs().sum() > 0, f"{method}: no gradient on {name}"


@pytest.mark.parametrize("method", ["gradcam", "grad_eclip"])
def test_create_graph_adds_the_second_order_term(ctx, method):
    with_graph = attribution_loss_grads(ctx, method, True)[0]
    without = attribution_loss_grads(ctx, method, False)[0]
    assert not scaled_close(with_graph, without, 1e-3)  # a difference far beyond rounding


def test_gradient_attribution_is_constant_without_create_graph(ctx):
    assert attribution_loss_grads(ctx, "gradient", False) == [None, None]


# ----------------------------------------------------------------------------------------------------------
# Image Grad-ECLIP
# ----------------------------------------------------------------------------------------------------------


def last_visual_block_input(model, image: Tensor) -> tuple[Tensor, Tensor]:
    """The residual stream entering the last ViT block [N, W] (open_clip's own forward) and its pooled output."""
    captured = []
    block = model.visual.transformer.resblocks[-1]
    handle = block.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    try:
        with torch.no_grad():
            pooled = model.encode_image(image[None])[0]
    finally:
        handle.remove()
    return captured[0][0], pooled


def reference_image_map(model, image: Tensor, text: Tensor, heads: str) -> Tensor:
    """Last block by hand (CLS row), per head and per patch; relu, min-max, bilinear upsample."""
    x, open_clip_pooled = last_visual_block_input(model, image)
    block = model.visual.transformer.resblocks[-1]
    x, record = naive_block(block, x, 0.0, block.attn.num_heads if heads == "multi" else 1)
    pooled = model.visual.ln_post(x[0]) @ model.visual.proj
    if heads == "multi":
        assert_close(pooled.detach(), open_clip_pooled)
    (grad,) = torch.autograd.grad(cosine(pooled, text), [record.context])
    patches = list(range(1, len(x)))
    values = eclip_map([record], [grad], 0, patches, len(x))[1:]
    scaled = (values - values.min()) / (values.max() - values.min())  # the original: min-max, then resize
    grid = scaled.view(1, 1, *model.visual.grid_size)
    return F.interpolate(grid, size=tuple(image.shape[-2:]), mode="bilinear", align_corners=False)[0, 0]


def assert_image_maps_match(model, images: Tensor, text: Tensor, heads: str) -> None:
    got = image_grad_eclip(CLIPEncoders(model), images, text, heads=heads).detach()
    expected = torch.stack([reference_image_map(model, image, row, heads) for image, row in zip(images, text)])
    assert got.shape == images[:, 0].shape
    assert_close(got, expected)


@pytest.mark.parametrize("heads", ["multi", "single"])
def test_image_grad_eclip_matches_reference(ctx, heads):
    assert_image_maps_match(ctx.model, ctx.images, ctx.text, heads)


def test_image_lambda_is_normalised_over_patches_only(ctx):
    """With the last block's key weights tied to its query weights, cos(q_cls, k_cls) = 1 is the largest
    cosine, so a min-max that wrongly included the CLS key would change every map."""
    model = copy.deepcopy(ctx.model)
    attn = model.visual.transformer.resblocks[-1].attn
    width = attn.embed_dim
    with torch.no_grad():
        attn.in_proj_weight[width:2 * width] = attn.in_proj_weight[:width]
        attn.in_proj_bias[width:2 * width] = attn.in_proj_bias[:width]
    assert_image_maps_match(model, ctx.images, ctx.text, "multi")


def any_size_block_input(model, image: Tensor) -> tuple[Tensor, tuple[int, int]]:
    """The residual stream entering the last ViT block [N, W] for an image of any size, as Grad-ECLIP's code
    embeds one: CLS then conv1's patches row by row; the patch position table, laid out on the model's grid,
    resized bicubically (align_corners=False) to the image's grid; ln_pre; every block but the last."""
    v = model.visual
    with torch.no_grad():
        patches = v.conv1(image[None])[0]  # [W, rows, columns]
        grid = tuple(patches.shape[-2:])
        table = v.positional_embedding[1:].T.reshape(1, -1, *v.grid_size)  # [1, W, model rows, model columns]
        resized = F.interpolate(table, size=grid, mode="bicubic", align_corners=False)[0].flatten(1).T
        x = torch.cat([v.class_embedding[None], patches.flatten(1).T])
        x = v.ln_pre(x + torch.cat([v.positional_embedding[:1], resized]))
        for block in v.transformer.resblocks[:-1]:
            x = block(x[None])[0]
    return x, grid


def reference_any_size_image_map(model, image: Tensor, text: Tensor, heads: str) -> tuple[Tensor, Tensor]:
    """The grid map [rows, columns] (relu'd, unscaled) of an image of any size, and its bilinear upsampling to
    the image after min-max, with the last block by hand as `reference_image_map`."""
    x, grid = any_size_block_input(model, image)
    block = model.visual.transformer.resblocks[-1]
    x, record = naive_block(block, x, 0.0, block.attn.num_heads if heads == "multi" else 1)
    pooled = model.visual.ln_post(x[0]) @ model.visual.proj
    (grad,) = torch.autograd.grad(cosine(pooled, text), [record.context])
    values = eclip_map([record], [grad], 0, list(range(1, len(x))), len(x))[1:].view(grid)
    scaled = (values - values.min()) / (values.max() - values.min())
    upsampled = F.interpolate(scaled[None, None], size=tuple(image.shape[-2:]), mode="bilinear", align_corners=False)
    return values, upsampled[0, 0]


@pytest.mark.parametrize("heads", ["single", "multi"])
@pytest.mark.parametrize("height, width", [(64, 96), (96, 48), (32, 64), (128, 128)])
def test_image_grad_eclip_runs_on_the_images_own_patch_grid(ctx, heads, height, width):
    """Grad-ECLIP explains aspect-preserving inputs: the ViT runs on the image's own patch grid, its positional
    embeddings resized to it; the map has that grid's shape (rows by columns) and is upsampled to the image."""
    images = torch.randn(2, 3, height, width, generator=torch.Generator().manual_seed(2))
    grid, _ = image_grad_eclip_grid(ctx.encoders, images, ctx.text[:2], heads=heads)
    maps = image_grad_eclip(ctx.encoders, images, ctx.text[:2], heads=heads).detach()
    references = [reference_any_size_image_map(ctx.model, image, text, heads) for image, text in zip(images, ctx.text)]
    assert grid.shape == (2, height // 16, width // 16) and maps.shape == (2, height, width)
    assert_close(grid.detach(), torch.stack([raw for raw, _ in references]))
    assert_close(maps, torch.stack([upsampled for _, upsampled in references]))


def test_at_the_models_size_nothing_is_resized(ctx):
    """A square input of the model's size keeps the model's own positional embeddings, so its maps are the ones
    computed through open_clip's own forward (`reference_image_map`)."""
    assert ctx.encoders.image_positions((4, 4), resize=True) is ctx.model.visual.positional_embedding
    assert_image_maps_match(ctx.model, ctx.images, ctx.text, "single")


def test_another_size_needs_resized_positions(ctx):
    wide = torch.randn(1, 3, 64, 96)
    with pytest.raises(ValueError, match=r"a 4 x 6 patch grid, the model's positional embeddings a 4 x 4 one"):
        ctx.encoders.encode_image(wide)
    with torch.no_grad():
        pooled = ctx.encoders.encode_image(wide, resize_positions=True).pooled[0]
        x, _ = any_size_block_input(ctx.model, wide[0])
        last = ctx.model.visual.transformer.resblocks[-1](x[None])[0]
        expected = ctx.model.visual.ln_post(last[0]) @ ctx.model.visual.proj
    assert_close(pooled, expected)


def test_image_grad_eclip_rejects_unknown_heads(ctx):
    with pytest.raises(ValueError, match="heads"):
        image_grad_eclip(ctx.encoders, ctx.images, ctx.text, heads="two")


# ----------------------------------------------------------------------------------------------------------
# Word groups, group means, registry, options, truncation
# ----------------------------------------------------------------------------------------------------------

SOT, EOT = 8, 9  # hand-built vocabulary: EOT has the largest id, as in open_clip
TOY_DECODER = {0: "!", 1: "un", 2: "believ", 3: "able</w>", 4: "cat</w>", 8: "<start_of_text>",
               9: "<end_of_text>", 12: "beyond</w>"}


def test_word_end_table_marks_pieces_ending_a_word():
    table = word_end_table(SimpleNamespace(decoder=TOY_DECODER), vocab_size=10)
    assert table.tolist() == [False, False, False, True, True, True, True, True, False, False]
    assert word_end_table(object(), vocab_size=10) is None


def test_word_groups_on_a_hand_built_batch():
    table = word_end_table(SimpleNamespace(decoder=TOY_DECODER), vocab_size=10)
    ids = torch.tensor([[SOT, 1, 2, 3, 4, EOT, 0],
                        [SOT, 4, 1, 2, EOT, 0, 0],  # the last word ends at EOS without "</w>"
                        [SOT, EOT, 0, 0, 0, 0, 0],
                        [SOT, 4, 6, 1, 4, EOT, 0]])  # id 6 is not in the decoder: a word of its own
    assert word_groups(ids, table).tolist() == [[-1, 0, 0, 0, 1, -1, -1],
                                                [-1, 0, 1, 1, -1, -1, -1],
                                                [-1, -1, -1, -1, -1, -1, -1],
                                                [-1, 0, 1, 2, 2, -1, -1]]
    assert word_groups(ids[:1], None).tolist() == [[-1, 0, 1, 2, 3, -1, -1]]


def test_word_groups_agree_with_the_real_tokenizer(ctx):
    groups = word_groups(ctx.ids, ctx.word_ends)
    for b, ids in enumerate(ctx.ids):
        expected = torch.full((len(ids),), -1)
        for index, word in enumerate(reference_words(ctx, ids)):
            expected[word] = index
        assert torch.equal(groups[b], expected)


def test_group_means_on_hand_made_tensors():
    attribution = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)  # longer than L
    means, has_any = group_means(attribution, mask)
    assert_close(means, torch.tensor([2.5, 0.0, 1.0]))
    assert has_any.tolist() == [True, False, True]


def test_unknown_method_lists_the_registered_ones(ctx):
    with pytest.raises(KeyError) as error:
        text_attribution("saliency", attribution_inputs(ctx))
    for name in ATTRIBUTIONS:
        assert name in str(error.value)


@pytest.mark.parametrize("options, message", [(AttributionOptions(layers=[5]), "out of range"),
                                              (AttributionOptions(head_reduce="sum"), "head_reduce")])
def test_attention_rejects_bad_options(ctx, options, message):
    with pytest.raises(ValueError, match=message):
        text_attribution("attention", attribution_inputs(ctx), options)


def test_grad_eclip_rejects_unknown_heads(ctx):
    with pytest.raises(ValueError, match="heads"):
        text_attribution("grad_eclip", attribution_inputs(ctx), AttributionOptions(heads="two"))


def test_options_from_a_config_section():
    options = attribution_options({"layers": (0, -1), "head_reduce": "max", "eclip_layers": 3, "weight": 1.0})
    assert options == AttributionOptions(layers=[0, -1], head_reduce="max", eclip_layers=3)


def test_encode_text_is_unchanged_by_truncation_after_the_last_eos(ctx):
    """The perturbation method encodes ids cut after the batch's last EOS."""
    length = max(eos_of(ctx, ids) for ids in ctx.ids) + 1
    with torch.no_grad():
        full = ctx.encoders.encode_text(ctx.ids).pooled
        truncated = ctx.encoders.encode_text(ctx.ids[:, :length]).pooled
        assert_close(truncated, full)
        assert_close(full, ctx.model.encode_text(ctx.ids))

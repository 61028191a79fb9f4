"""CLIPEncoders against open_clip's own forward, naive attention, and embedding-level masking."""
from __future__ import annotations

import gc
import weakref

import open_clip
import pytest
import torch

from modeling.encoders import CLIPEncoders, build_model, canonical_model_name
from tolerance import scaled_close

CAPTIONS = ["a red square to the left of a blue circle", "a horse riding a man", "two dogs"]
# Two code paths of a float32 tower (fused attention against the explicit one, a trimmed sequence against
# the full one) round differently: up to ~1e-6 of the largest feature (8e-7 seen for ViT-B-32's 12 blocks).
RTOL = 1e-5


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    built = build_model("ViT-Tiny-16-64", None, "configs/models")
    return built, CLIPEncoders(built.model.eval())


def images_for(model, n=3, seed=0):
    size = model.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


# ViT-Shapes-8-32-SinCos: a fixed 2-D sin-cos position table instead of a learned one (the study diagnosis).
@pytest.mark.parametrize("name", ["ViT-Tiny-16-64", "ViT-B-32", "ViT-Shapes-8-32-SinCos"])
def test_plain_outputs_equal_open_clip(name):
    built = build_model(name, None, "configs/models")
    model, encoders = built.model.eval(), CLIPEncoders(built.model)
    ids, images = built.tokenizer(CAPTIONS), images_for(model)
    with torch.no_grad():
        assert scaled_close(encoders.encode_text(ids).pooled, model.encode_text(ids), RTOL)
        image = encoders.encode_image(images)
        assert scaled_close(image.pooled, model.encode_image(images), RTOL)
    grid = model.visual.grid_size
    assert image.patches.shape == (3, grid[0] * grid[1], model.visual.output_dim)


def test_tokens_hold_the_pooled_feature_at_eos(tiny):
    built, encoders = tiny
    ids = built.tokenizer(CAPTIONS)
    with torch.no_grad():
        text = encoders.encode_text(ids)
    eos = ids.argmax(dim=-1)
    assert torch.equal(text.tokens[torch.arange(len(ids)), eos], text.pooled)
    assert text.tokens.shape == (3, ids.shape[1], built.model.text_projection.shape[1])


def naive_attention(block, x, attn_mask):
    """Per-head softmax(q k^T / sqrt(d) + mask) written out with the block's weight slices."""
    width, heads = x.shape[-1], block.attn.num_heads
    head_dim = width // heads
    h = block.ln_1(x)
    w, b = block.attn.in_proj_weight, block.attn.in_proj_bias
    maps = []
    for head in range(heads):
        rows = slice(head * head_dim, (head + 1) * head_dim)
        q = h @ w[rows].T + b[rows]
        k = h @ w[width:2 * width][rows].T + b[width:2 * width][rows]
        maps.append(torch.softmax(q @ k.transpose(-1, -2) / head_dim ** 0.5 + attn_mask, dim=-1))
    return torch.stack(maps, dim=1)


def test_attention_equals_naive_recomputation_and_features_unchanged(tiny):
    built, encoders = tiny
    model = built.model
    ids = built.tokenizer(CAPTIONS)
    block_inputs = []
    hooks = [blk.register_forward_pre_hook(lambda mod, args, kw: block_inputs.append(args[0]), with_kwargs=True)
             for blk in model.transformer.resblocks]
    with torch.no_grad():
        model.encode_text(ids)
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        plain, with_attn = encoders.encode_text(ids), encoders.encode_text(ids, attn=True)
    assert len(with_attn.attentions) == len(model.transformer.resblocks)
    for block, x, probs in zip(model.transformer.resblocks, block_inputs, with_attn.attentions):
        assert scaled_close(probs, naive_attention(block, x, model.attn_mask), RTOL)
        assert scaled_close(probs.sum(-1), torch.ones(()), RTOL)  # <= 77 terms
        assert probs[..., 0, 1:].abs().max() == 0  # causal: SOT attends only to itself
    assert scaled_close(with_attn.pooled, plain.pooled, RTOL)
    assert scaled_close(with_attn.tokens, plain.tokens, RTOL)


def test_attention_stays_in_the_graph(tiny):
    built, encoders = tiny
    ids = built.tokenizer(CAPTIONS[:1])
    attentions = encoders.encode_text(ids, attn=True).attentions
    eos = int(ids.argmax())
    attentions[-1][0, :, eos, 1:eos].sum().backward()
    grads = [blk.attn.in_proj_weight.grad for blk in built.model.transformer.resblocks]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    built.model.zero_grad(set_to_none=True)


def test_text_mask_token_replaces_embedding_before_positions(tiny):
    """Replacing by the embedding row of token t == feeding token t (positions added afterwards)."""
    built, encoders = tiny
    ids = built.tokenizer(CAPTIONS)
    replace = torch.zeros_like(ids, dtype=torch.bool)
    replace[0, 2], replace[1, 3], replace[1, 4] = True, True, True
    substitute_id = 1125
    mask_token = built.model.token_embedding.weight[substitute_id].detach().clone()
    edited = ids.clone()
    edited[replace] = substitute_id
    with torch.no_grad():
        masked = encoders.encode_text(ids, replace=replace, mask_token=mask_token)
        expected = encoders.encode_text(edited)
        untouched = encoders.encode_text(ids, replace=torch.zeros_like(replace), mask_token=mask_token)
    assert scaled_close(masked.tokens, expected.tokens, RTOL)
    # the same inputs through the same kernels: equal up to the last bits
    assert scaled_close(untouched.pooled, encoders.encode_text(ids).pooled, 1e-6)
    assert not scaled_close(masked.pooled[0], untouched.pooled[0], 1e-3)
    assert scaled_close(masked.pooled[2], untouched.pooled[2], 1e-6)  # row without masked tokens


def test_image_mask_token_replaces_patch_embedding_before_positions(tiny):
    """Replacing patch k by the embedding of another image's patch == pasting that patch's pixels."""
    built, encoders = tiny
    model = built.model
    images = images_for(model, n=2, seed=1)
    source = images_for(model, n=1, seed=2)
    patch = model.visual.patch_size[0]
    grid = model.visual.grid_size[1]
    k = 5
    row, col = divmod(k, grid)
    pixels = (slice(None), slice(None), slice(row * patch, (row + 1) * patch), slice(col * patch, (col + 1) * patch))
    with torch.no_grad():
        mask_token = encoders.patch_embeddings(source)[0, k]
        pasted = images.clone()
        pasted[pixels] = source[pixels].expand(2, -1, -1, -1)
        replace = torch.zeros(2, grid * grid, dtype=torch.bool)
        replace[:, k] = True
        masked = encoders.encode_image(images, replace=replace, mask_token=mask_token)
        assert scaled_close(masked.pooled, model.encode_image(pasted), RTOL)
        assert not scaled_close(masked.pooled, model.encode_image(images), 1e-3)


def test_replace_needs_a_mask_token_and_the_right_shape(tiny):
    built, encoders = tiny
    ids = built.tokenizer(CAPTIONS)
    with pytest.raises(ValueError, match="mask_token"):
        encoders.encode_text(ids, replace=torch.zeros_like(ids, dtype=torch.bool))
    with pytest.raises(ValueError, match="shape"):
        encoders.encode_text(ids, replace=torch.zeros(3, 5, dtype=torch.bool), mask_token=torch.zeros(64))


def test_openai_weights_are_built_with_quickgelu():
    assert canonical_model_name("ViT-B-32", "openai") == "ViT-B-32-quickgelu"
    assert canonical_model_name("ViT-B-32-quickgelu", "openai") == "ViT-B-32-quickgelu"
    assert canonical_model_name("ViT-B-32", None) == "ViT-B-32"


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown open_clip model"):
        build_model("ViT-B-33", None, "configs/models")


def test_trimming_after_the_last_eos_keeps_the_pooled_text_features():
    model = build_model("ViT-Tiny-16-64", None, "configs/models").model.eval()
    tokenizer = open_clip.get_tokenizer("ViT-Tiny-16-64")
    encoders = CLIPEncoders(model)
    ids = tokenizer(["a red cube left of a blue ball", "a dog", ""])
    with torch.no_grad():
        full = encoders.encode_text(ids)
        trimmed = encoders.encode_text(ids, trim=True)
        traced = encoders.encode_text(ids, attn=True, trim=True)
    assert trimmed.tokens.shape[1] == int(ids.argmax(-1).max()) + 1 < ids.shape[1]
    assert scaled_close(trimmed.pooled, full.pooled, RTOL)
    assert scaled_close(traced.pooled, full.pooled, RTOL)
    assert scaled_close(trimmed.tokens, full.tokens[:, : trimmed.tokens.shape[1]], RTOL)


def quick_or_plain_gelu_model(quick_gelu: bool):
    build_model("ViT-Tiny-16-64", None, "configs/models")  # registers the tiny config
    torch.manual_seed(0)
    return open_clip.create_model("ViT-Tiny-16-64", force_quick_gelu=quick_gelu).train()


def weighted_sum(*tensors: torch.Tensor) -> torch.Tensor:
    """A loss that weights every entry differently (a plain sum would hide transposed or swapped entries)."""
    return sum((t * torch.linspace(-1, 1, t.numel()).view_as(t)).sum() for t in tensors)


@pytest.mark.parametrize("quick_gelu", [False, True])
def test_recomputed_mlp_activations_give_the_same_values_and_gradients(quick_gelu):
    """MACCO's memory saver (recompute_activations): the activation is computed again from the kept
    pre-activation by the same kernels, so the features and every gradient are equal bit for bit."""
    model = quick_or_plain_gelu_model(quick_gelu)
    encoders = CLIPEncoders(model)
    ids, images = open_clip.get_tokenizer("ViT-Tiny-16-64")(CAPTIONS), images_for(model)
    runs = []
    for recompute in (False, True):
        encoders.recompute_activations = recompute
        text, image = encoders.encode_text(ids, trim=True), encoders.encode_image(images)
        outputs = (text.tokens, text.pooled, image.patches, image.pooled)
        grads = torch.autograd.grad(weighted_sum(*outputs), list(model.parameters()), allow_unused=True)
        runs.append(([o.detach() for o in outputs], grads))
    (plain_out, plain_grads), (recomputed_out, recomputed_grads) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain_out, recomputed_out))
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(plain_grads, recomputed_grads))


def test_recomputed_mlp_activations_under_bf16_autocast_with_two_forwards_in_one_region():
    """Mixed precision, as bf16-mixed training runs MACCO: the second text forward of an autocast region finds
    the weights' bf16 copies in autocast's cache, the recomputation in the backward would not; the recomputed
    path still runs. Its values are the plain path's bit for bit; so are the gradients except c_proj's, whose
    weight it casts once per forward: their two parts add in float32, not in bfloat16 (one bf16 rounding)."""
    model = quick_or_plain_gelu_model(quick_gelu=True)
    encoders = CLIPEncoders(model)
    ids = open_clip.get_tokenizer("ViT-Tiny-16-64")(CAPTIONS)
    runs = []
    for recompute in (False, True):
        encoders.recompute_activations = recompute
        with torch.autocast("cpu", dtype=torch.bfloat16):
            first, second = encoders.encode_text(ids, trim=True), encoders.encode_text(ids.flip(0), trim=True)
            outputs = (first.tokens, second.tokens, first.pooled, second.pooled)
        assert first.tokens.dtype == torch.bfloat16
        grads = torch.autograd.grad(weighted_sum(*outputs), list(model.parameters()), allow_unused=True)
        runs.append(([o.detach() for o in outputs], grads))
    (plain_out, plain_grads), (recomputed_out, recomputed_grads) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain_out, recomputed_out))
    for (name, _), plain, recomputed in zip(model.named_parameters(), plain_grads, recomputed_grads):
        assert (plain is None) == (recomputed is None), name
        if plain is not None and ".mlp.c_proj." in name:
            assert scaled_close(recomputed, plain, 1e-2), name  # bfloat16 keeps 8 bits: 2^-8 = 4e-3
        elif plain is not None:
            assert torch.equal(recomputed, plain), name


@pytest.mark.parametrize("quick_gelu", [False, True])
def test_recomputed_mlp_activations_are_not_kept_for_the_backward(quick_gelu):
    """With recompute_activations nothing holds a block's activation output once the forward is done (the graph
    keeps the pre-activation only); without it the graph keeps it for c_proj's backward."""
    model = quick_or_plain_gelu_model(quick_gelu)
    encoders = CLIPEncoders(model)
    activation = model.visual.transformer.resblocks[0].mlp.gelu
    kept = {}
    for recompute in (False, True):
        encoders.recompute_activations = recompute
        outputs = []
        hook = activation.register_forward_hook(lambda module, args, output: outputs.append(weakref.ref(output)))
        try:
            pooled = encoders.encode_image(images_for(model)).pooled  # the graph stays alive with `pooled`
        finally:
            hook.remove()
        gc.collect()
        kept[recompute] = [ref() is not None for ref in outputs]
        pooled.sum().backward()  # the recomputation runs (and finds its input) in the backward
    assert kept == {False: [True], True: [False]}


def first_difference(ids: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    return (ids != sources).to(torch.int64).argmax(dim=1)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_continuations_of_a_shared_prefix_equal_whole_forwards(tiny, chunk_size):
    """encode_text_continuations runs only positions start..EOS of captions that agree with an encoded caption
    before `start`; pooled features and their gradients are those of whole forwards, whether a continuation is
    longer than its source, shorter (down to EOS alone) or as long, from a trimmed source forward, all at once or
    in chunks (sorted by length, returned in the given order)."""
    built, encoders = tiny
    tokenizer = built.tokenizer
    sources = tokenizer(["a red cube left of a blue ball", "a dog on a mat"])
    variants = tokenizer(["a red sphere left of a blue ball", "a red cube far to the right of a blue ball",
                          "a red cube", "a dog under the old wooden table", "a cat on a mat"])
    source = torch.tensor([0, 0, 0, 1, 1])
    start = first_difference(variants, sources[source])
    assert start.tolist() == [3, 4, 4, 3, 2]  # "a red cube" ends where the source goes on: EOS alone runs
    parameters = [p for name, p in built.model.named_parameters() if not name.startswith("visual.")]
    text = encoders.encode_text(sources, trim=True, keep_block_inputs=True)
    assert len(text.block_inputs) == len(built.model.transformer.resblocks)
    continued = encoders.encode_text_continuations(variants, start, source, text.block_inputs, chunk_size)
    whole = encoders.encode_text(variants).pooled
    assert scaled_close(continued.detach(), whole.detach(), RTOL)
    continued_grads = torch.autograd.grad(weighted_sum(continued), parameters, allow_unused=True)
    whole_grads = torch.autograd.grad(weighted_sum(whole), parameters, allow_unused=True)
    for name, a, b in zip([n for n, _ in built.model.named_parameters() if not n.startswith("visual.")],
                          continued_grads, whole_grads):
        assert (a is None) == (b is None), name
        assert a is None or scaled_close(a, b, RTOL), name


def test_continuations_under_bf16_autocast_follow_whole_forwards(tiny):
    """bf16-mixed training (CAE's perturbation on a GPU): the packed continuation rows come out of autocast in
    bfloat16 and the result matches whole forwards under the same autocast to bfloat16's rounding (8 bits)."""
    built, encoders = tiny
    sources = built.tokenizer(["a red cube left of a blue ball", "a dog on a mat"])
    variants = built.tokenizer(["a red sphere left of a blue ball", "a cat on a mat"])
    source = torch.tensor([0, 1])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        text = encoders.encode_text(sources, trim=True, keep_block_inputs=True)
        start = first_difference(variants, sources)
        continued = encoders.encode_text_continuations(variants, start, source, text.block_inputs)
        whole = encoders.encode_text(variants).pooled
    assert continued.dtype == torch.bfloat16
    assert scaled_close(continued.float(), whole.float(), 3e-2)


def test_sincos_shapes_model_has_a_fixed_position_table_per_patch():
    visual = build_model("ViT-Shapes-8-32-SinCos", None, "configs/models").model.visual
    table = visual.positional_embedding
    # Not a parameter the optimiser moves; one row for the class token (zeros) and one per patch of the 4 x 4 grid.
    assert not table.requires_grad
    assert table.shape == (1 + 4 * 4, 128)
    assert torch.count_nonzero(table[0]) == 0
    assert len({tuple(row.tolist()) for row in table[1:]}) == 16

"""MACCO-CLIP: each loss term against a slow reference, the stop-gradients, mask tokens, predictors, parameter
groups, configs, a smoke fit on the shapes world with masks, and the export in plain open_clip."""
from __future__ import annotations

import math
import os

import open_clip
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from fitting import tiny_config

from core.config import REPO_ROOT, ConfigError
from lightning_modules import load_run_config
from modeling.encoders import TextFeatures
from modeling.export import load_export
from lightning_modules import METHODS
from lightning_modules.base import total_loss
from lightning_modules.fit import run
from modeling.losses import (masked_contrastive_loss, masked_patch_loss, masked_token_loss,
                                      normalised_patch_targets, patchify)
from lightning_modules.methods.macco import MaccoCLIP, padding_positions, run_stack, sincos_2d_positions
from tolerance import scaled_close

CAPTIONS = ["a red cube to the left of a blue ball", "a man riding a horse", "a dog", "a small green triangle"]
GRID, PATCH = 4, 16  # ViT-Tiny-16-64


# ----- slow references -----------------------------------------------------------------------------------
def reference_infonce(rows, columns, positives, scale):
    """Mean over rows of -log softmax(scale * <row, column>)[positive], one row at a time."""
    total = 0.0
    for row, positive in zip(rows, positives):
        scores = torch.stack([scale * row.dot(column) for column in columns])
        total = total - (scores[positive] - torch.logsumexp(scores, 0))
    return total / len(rows)


def reference_mca(images, masked_images, texts, masked_texts, scale, negatives=None):
    """[I; I~] against [T; T~] and back; anchor b and its masked copy both have positive column b. With NegCLIP's
    hard captions `negatives` [B, K, D]: every image row also scores all B * K of them (after the positives, as
    CLIP-FT's ClipLoss); the text rows score the images only. A masked copy given as None is left out: no row,
    no column."""
    n = images.shape[0]
    image_rows = list(images) + (list(masked_images) if masked_images is not None else [])
    text_rows = list(texts) + (list(masked_texts) if masked_texts is not None else [])
    hard = [] if negatives is None else [negatives[b, k] for b in range(n) for k in range(negatives.shape[1])]
    return (reference_infonce(image_rows, text_rows + hard, list(range(n)) * (len(image_rows) // n), scale) +
            reference_infonce(text_rows, image_rows, list(range(n)) * (len(text_rows) // n), scale)) / 2


def reference_clip(a, b, scale):
    positives = list(range(a.shape[0]))
    return (reference_infonce(list(a), list(b), positives, scale) + reference_infonce(list(b), list(a), positives,
                                                                                       scale)) / 2


def reference_masked_mean(per_sample_values):
    """per_sample_values: one list of per-position losses per sample; empty samples are left out."""
    kept = [sum(values) / len(values) for values in per_sample_values if values]
    return sum(kept) / len(kept) if kept else 0.0


def reference_patch(image, row, col, patch):
    """One patch's values in (row in patch, column in patch, channel) order, channel fastest."""
    return torch.stack([image[c, row * patch + i, col * patch + j] for i in range(patch) for j in range(patch)
                        for c in range(image.shape[0])])


def reference_normalised(values):
    n = values.numel()
    mean = values.sum() / n
    var = ((values - mean) ** 2).sum() / (n - 1)  # unbiased, as the original
    return (values - mean) / torch.sqrt(var + 1e-6)


def unit(*shape, seed=0):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dim=-1)


# ----- loss functions on hand-made features --------------------------------------------------------------
def test_masked_contrastive_loss_matches_the_slow_reference():
    feats = [unit(3, 5, seed=s) for s in range(4)]
    scale = torch.tensor(9.0, dtype=torch.float64)
    loss = masked_contrastive_loss(*feats, scale)
    assert loss.dtype == torch.float32
    # float32 against the float64 reference: logits of size <= 9, ~1e-7 relative rounding
    assert loss.item() == pytest.approx(float(reference_mca(*feats, scale)), rel=1e-5)
    # the masked copies matter: they are extra anchors and negatives (not a plain B x B CLIP loss)
    assert loss.item() != pytest.approx(float(reference_clip(feats[0], feats[2], scale)), rel=1e-3)


@pytest.mark.parametrize("masked", ["text", "image", "none"])
def test_masked_contrastive_loss_with_one_masked_copy_matches_the_slow_reference(masked):
    """`method.mca_masked` [ours]: only the masked captions ([I] x [T; T~] and back), only the masked images
    ([I; I~] x [T]), or neither (CLIP's B x B loss); with NegCLIP's hard captions as extra columns."""
    images, masked_images, texts, masked_texts = [unit(3, 5, seed=s) for s in range(4)]
    masked_images = masked_images if masked == "image" else None
    masked_texts = masked_texts if masked == "text" else None
    negatives = unit(3, 2, 5, seed=4)
    scale = torch.tensor(9.0, dtype=torch.float64)
    for hard in (None, negatives):
        loss = masked_contrastive_loss(images, masked_images, texts, masked_texts, scale, hard)
        expected = reference_mca(images, masked_images, texts, masked_texts, scale, hard)
        assert loss.item() == pytest.approx(float(expected), rel=1e-5)  # float32 against float64, logits <= 9
    plain = masked_contrastive_loss(images, masked_images, texts, masked_texts, scale)
    both = masked_contrastive_loss(images, unit(3, 5, seed=1), texts, unit(3, 5, seed=3), scale)
    assert plain.item() != pytest.approx(both.item(), rel=1e-3)  # another loss than the paper's
    if masked == "none":
        assert plain.item() == pytest.approx(float(reference_clip(images, texts, scale)), rel=1e-5)


def test_masked_contrastive_loss_with_hard_negatives_matches_the_slow_reference():
    feats = [unit(3, 5, seed=s) for s in range(4)]
    negatives = unit(3, 2, 5, seed=4)
    scale = torch.tensor(9.0, dtype=torch.float64)
    loss = masked_contrastive_loss(*feats, scale, negatives)
    # float32 against the float64 reference: logits of size <= 9, ~1e-7 relative rounding
    assert loss.item() == pytest.approx(float(reference_mca(*feats, scale, negatives)), rel=1e-5)
    # the hard captions are extra columns of the image-to-text direction only: the loss rises by half the
    # difference of that direction's cross-entropies, the text-to-image half is the same
    image_rows, text_rows = list(feats[0]) + list(feats[1]), list(feats[2]) + list(feats[3])
    hard = [negatives[b, k] for b in range(3) for k in range(2)]
    positives = list(range(3)) * 2
    rise = (reference_infonce(image_rows, text_rows + hard, positives, scale) -
            reference_infonce(image_rows, text_rows, positives, scale)) / 2
    plain = masked_contrastive_loss(*feats, scale)
    assert (loss - plain).item() == pytest.approx(float(rise), rel=1e-4)  # a difference of two ~1e-7-rounded losses
    assert rise > 0.05


def test_masked_token_loss_matches_a_loop_and_leaves_out_empty_samples():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 1, 0, 1, 1, 0]], dtype=torch.bool)
    targets_full = torch.randint(0, 7, (3, 6), generator=g)
    logits = torch.randn(int(mask.sum()), 7, generator=g, requires_grad=True)
    loss = masked_token_loss(logits, targets_full[mask], mask)
    rows = mask.nonzero().tolist()
    per_sample = [[] for _ in range(3)]
    for (b, t), row in zip(rows, logits):
        per_sample[b].append(float(-(row.detach().log_softmax(0)[targets_full[b, t]])))
    assert per_sample[1] == []  # the empty sample is excluded (not counted as 0)
    assert loss.item() == pytest.approx(reference_masked_mean(per_sample), rel=1e-5)  # float32 sums of 7 terms
    loss.backward()
    assert logits.grad.abs().sum() > 0


def test_no_masked_token_or_patch_gives_zero_not_nan():
    logits = torch.zeros(0, 7, requires_grad=True)
    loss = masked_token_loss(logits, torch.zeros(0, dtype=torch.long), torch.zeros(2, 5, dtype=torch.bool))
    assert loss.item() == 0.0 and loss.requires_grad
    predicted = torch.randn(2, 4, 6, requires_grad=True)
    loss = masked_patch_loss(predicted, torch.randn(2, 4, 6), torch.zeros(2, 4, dtype=torch.bool))
    assert loss.item() == 0.0 and loss.requires_grad


def test_patch_targets_are_channel_last_patches_normalised_with_the_unbiased_variance():
    images = torch.randn(2, 3, 8, 12, generator=torch.Generator().manual_seed(1))
    patches, targets = patchify(images, 4), normalised_patch_targets(images, 4)
    assert patches.shape == targets.shape == (2, 6, 48)
    for b in range(2):
        for r in range(2):
            for c in range(3):
                expected = reference_patch(images[b], r, c, 4)
                assert torch.equal(patches[b, r * 3 + c], expected)  # row-major patch order, like ViT
                # float32 mean and variance of 48 values; values near 0 round like the largest ones
                assert scaled_close(targets[b, r * 3 + c], reference_normalised(expected), 1e-5)


def test_masked_patch_loss_matches_a_loop_and_leaves_out_empty_samples():
    g = torch.Generator().manual_seed(2)
    predicted, target = torch.randn(3, 4, 6, generator=g), torch.randn(3, 4, 6, generator=g)
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.bool)
    per_sample = [[float(((predicted[b, p] - target[b, p]) ** 2).mean()) for p in range(4) if mask[b, p]]
                  for b in range(3)]
    assert masked_patch_loss(predicted, target, mask).item() == pytest.approx(reference_masked_mean(per_sample),
                                                                              rel=1e-5)


def test_sincos_positions_follow_mae_column_half_first():
    positions = sincos_2d_positions(8, (2, 3))
    assert positions.shape == (6, 8)
    row, col = 1, 2  # patch 5
    omega = [1.0, 1 / 100.0]  # 1 / 10000^(k / 2), k = 0, 1
    expected = [math.sin(col * w) for w in omega] + [math.cos(col * w) for w in omega] + \
               [math.sin(row * w) for w in omega] + [math.cos(row * w) for w in omega]
    # float32 sin / cos of arguments <= 2: ~1e-7 absolute, relative to the scale 1 (sin 0 = 0 is among them)
    assert scaled_close(positions[row * 3 + col], torch.tensor(expected), 1e-6)


# ----- the module on a hand-made batch -------------------------------------------------------------------
def make_module(*overrides: str) -> MaccoCLIP:
    cfg = load_run_config([], ["model.name=ViT-Tiny-16-64", "method.name=macco", *overrides])
    torch.manual_seed(0)
    return MaccoCLIP(cfg).train()


@pytest.fixture(scope="module")
def module() -> MaccoCLIP:
    return make_module()


def make_batch(module: MaccoCLIP) -> dict:
    ids = module.tokenizer(CAPTIONS)
    comp = torch.zeros_like(ids, dtype=torch.bool)
    comp[0, [2, 6, 7, 8]] = True  # "red", "left of" ...
    comp[1, 3] = True  # "riding"
    comp[3, [2, 3]] = True  # "small green"; "a dog" (row 2) has no composition word: empty text mask
    comp[0, 0] = True  # SOT is never masked, even if a mask says so
    patch = torch.zeros(len(CAPTIONS), GRID * GRID, dtype=torch.bool)
    patch[0, [0, 1, 4, 5]] = True
    patch[1, 10] = True
    patch[2, 8:] = True  # row 3 has an empty patch mask
    images = torch.randn(len(CAPTIONS), 3, 64, 64, generator=torch.Generator().manual_seed(3))
    return {"image": images, "text": ids, "comp_mask": comp, "patch_mask": patch}


def test_default_weights_are_the_papers():
    m = load_run_config([], ["method.name=macco"]).method
    assert (m.mca_weight, m.mir_weight, m.mlm_weight, m.mim_weight) == (1.0, 0.1, 20.0, 250.0)
    assert (m.text_predictor_depth, m.image_predictor_depth) == (2, 3)
    assert m.key_padding_mask  # the schema's default is ours; configs/macco.yaml turns it off (the original)
    assert m.mca_masked == "both"  # the paper's contrast; text / image / none are ours
    with pytest.raises(ConfigError, match="mca_masked"):
        load_run_config([], ["method.name=macco", "method.mca_masked=captions"])


def test_every_term_equals_its_slow_reference_with_its_weight(module):
    batch = make_batch(module)
    torch.manual_seed(0)
    terms, report = module.compute_terms(batch)
    out = module.macco_forward(batch)  # deterministic: the same tensors as inside compute_terms
    scale = module.clip.logit_scale.exp().detach()
    n = lambda x: F.normalize(x.detach(), dim=-1)  # noqa: E731
    image, masked_image = n(out.image.pooled), n(out.masked_image.pooled)
    text, masked_text = n(out.text.pooled), n(out.masked_text.pooled)
    assert terms["mca_loss"].item() == pytest.approx(float(reference_mca(image, masked_image, text, masked_text,
                                                                         scale)), rel=1e-5)
    mir = (reference_clip(masked_text, text, scale) + reference_clip(masked_image, image, scale)) / 2
    # a cross-entropy of ~0.7 from logits of size ~14: cancellation makes its rounding ~2e-6 relative
    assert terms["mir_loss"].item() == pytest.approx(0.1 * float(mir), rel=2e-5)
    # L_mlm: the full vocabulary head at every masked (sample, position), against the caption's own token
    ids = batch["text"]
    per_sample = [[] for _ in CAPTIONS]
    for b in range(len(CAPTIONS)):
        for t in range(1, int(ids[b].argmax())):
            if batch["comp_mask"][b, t]:
                logits = module.text_predictor.logits(out.text_predictor_features[b, t].detach())
                per_sample[b].append(float(-logits.log_softmax(0)[ids[b, t]]))
    assert per_sample[2] == [] and len(per_sample[0]) == 4  # SOT dropped from row 0's mask
    assert terms["mlm_loss"].item() == pytest.approx(20 * reference_masked_mean(per_sample), rel=1e-5)
    # L_mim: the predicted pixels of each masked patch against that patch of the input, normalised
    per_sample = [[] for _ in CAPTIONS]
    for b in range(len(CAPTIONS)):
        for p in range(GRID * GRID):
            if batch["patch_mask"][b, p]:
                target = reference_normalised(reference_patch(batch["image"][b], p // GRID, p % GRID, PATCH))
                per_sample[b].append(float(((out.pixel_predictions[b, p].detach() - target) ** 2).mean()))
    assert terms["mim_loss"].item() == pytest.approx(250 * reference_masked_mean(per_sample), rel=1e-5)
    assert report["unweighted/mim"].item() == pytest.approx(reference_masked_mean(per_sample), rel=1e-5)


# NegCLIP's hard captions of CAPTIONS: attribute / relation swaps and replaced objects (K = 2 per caption)
HARD_CAPTIONS = [["a blue cube to the left of a red ball", "a blue ball to the left of a red cube"],
                 ["a horse riding a man", "a man riding a camel"], ["a cat", "two dogs"],
                 ["a green small triangle", "a small red triangle"]]


def with_hard_captions(module: MaccoCLIP, batch: dict) -> dict:
    return {**batch, "neg_text": torch.stack([module.tokenizer(captions) for captions in HARD_CAPTIONS])}


def test_hard_negatives_are_extra_image_to_text_columns_of_l_mca_in_training_only(module):
    """MACCO + NegCLIP: L_mca with the hard captions (open_clip's own text forward) equals the float64 reference;
    the other three terms, validation, and a run without the option are unchanged."""
    negclip = make_module("method.hard_negatives.captions=2")  # the same weights as `module` (seed 0)
    batch = with_hard_captions(negclip, make_batch(negclip))
    terms, report = negclip.compute_terms(batch)
    plain, plain_report = module.compute_terms(batch)  # neg_text in the batch, option off: ignored
    without_negatives, _ = module.compute_terms(make_batch(module))
    with torch.no_grad():
        out = negclip.macco_forward(batch)  # deterministic: the same tensors as inside compute_terms
        n = lambda x: F.normalize(x.double(), dim=-1)  # noqa: E731
        hard = n(negclip.clip.encode_text(batch["neg_text"].flatten(0, 1))).view(4, 2, -1)
        scale = negclip.clip.logit_scale.exp().double()
        expected = reference_mca(n(out.image.pooled), n(out.masked_image.pooled), n(out.text.pooled),
                                 n(out.masked_text.pooled), scale, hard)
        without = reference_mca(n(out.image.pooled), n(out.masked_image.pooled), n(out.text.pooled),
                                n(out.masked_text.pooled), scale)
    assert terms["mca_loss"].item() == pytest.approx(float(expected), rel=1e-5)  # float32 logits of size <= 14
    assert float(expected) > float(without) + 0.01  # the hard captions are in the loss
    assert plain["mca_loss"].item() == pytest.approx(float(without), rel=1e-5)
    for name in ("mir_loss", "mlm_loss", "mim_loss"):  # the same forward: the same values
        assert terms[name].item() == pytest.approx(plain[name].item(), rel=1e-6), name
    for name in plain:
        assert plain[name].item() == without_negatives[name].item(), name
    assert set(report) == set(plain_report)
    negclip.eval()
    with torch.no_grad():  # validation scores the plain L_mca
        validation, _ = negclip.compute_terms(batch)
    assert validation["mca_loss"].item() == pytest.approx(float(without), rel=1e-5)


@pytest.mark.parametrize("masked", ["text", "image"])
def test_mca_masked_takes_one_masked_copy_out_of_l_mca_and_changes_no_other_term(module, masked):
    variant = make_module(f"method.mca_masked={masked}")  # the same weights as `module` (seed 0)
    batch = make_batch(variant)
    terms, _ = variant.compute_terms(batch)
    paper, _ = module.compute_terms(batch)
    with torch.no_grad():
        out = variant.macco_forward(batch)
        n = lambda x: F.normalize(x.double(), dim=-1)  # noqa: E731
        expected = reference_mca(n(out.image.pooled), n(out.masked_image.pooled) if masked == "image" else None,
                                 n(out.text.pooled), n(out.masked_text.pooled) if masked == "text" else None,
                                 variant.clip.logit_scale.exp().double())
    assert terms["mca_loss"].item() == pytest.approx(float(expected), rel=1e-5)
    assert terms["mca_loss"].item() != pytest.approx(paper["mca_loss"].item(), rel=1e-3)
    for name in ("mir_loss", "mlm_loss", "mim_loss"):  # the same forward: the same values
        assert terms[name].item() == pytest.approx(paper[name].item(), rel=1e-6), name


def test_hard_negatives_without_hard_captions_in_the_batch_name_the_setting():
    negclip = make_module("method.hard_negatives.captions=2")
    with pytest.raises(KeyError, match="method.hard_negatives.captions > 0"):
        negclip.compute_terms(make_batch(negclip))


def test_report_counts_masked_tokens_patches_and_empty_samples(module):
    _, report = module.compute_terms(make_batch(module))
    assert report["mask/text_tokens"].item() == 7  # 4 + 1 + 0 + 2 (SOT excluded)
    assert report["mask/image_patches"].item() == 4 + 1 + 8
    assert report["mask/text_empty_fraction"].item() == 0.25
    assert report["mask/image_empty_fraction"].item() == 0.25


def grads_reach(loss, params) -> bool:
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return any(g is not None and g.abs().sum() > 0 for g in grads)


def test_stop_gradients_by_gradient_inspection():
    """Image encoder: only L_mca and L_mir. L_mlm: text encoder, not the image encoder. L_mim: text encoder
    (the keys are not detached), neither the image encoder nor the image mask token (queries detached)."""
    module = make_module()
    terms, _ = module.compute_terms(make_batch(module))
    clip = module.clip
    image_encoder = list(clip.visual.parameters())
    text_encoder = [p for name, p in clip.named_parameters()
                    if not name.startswith("visual.") and name != "logit_scale"]
    reaches = {name: {"image": grads_reach(terms[f"{name}_loss"], image_encoder),
                      "text": grads_reach(terms[f"{name}_loss"], text_encoder),
                      "img_mask_token": grads_reach(terms[f"{name}_loss"], [module.img_mask_token]),
                      "text_mask_token": grads_reach(terms[f"{name}_loss"], [module.text_mask_token])}
               for name in ("mca", "mir", "mlm", "mim")}
    assert reaches["mca"] == {"image": True, "text": True, "img_mask_token": True, "text_mask_token": True}
    assert reaches["mir"] == {"image": True, "text": True, "img_mask_token": True, "text_mask_token": True}
    assert reaches["mlm"] == {"image": False, "text": True, "img_mask_token": False, "text_mask_token": True}
    assert reaches["mim"] == {"image": False, "text": True, "img_mask_token": False, "text_mask_token": False}


def test_vocabulary_head_runs_on_masked_positions_only_and_equals_the_full_head(module):
    shapes = []
    hook = module.text_predictor.head.register_forward_hook(lambda mod, inputs, output: shapes.append(inputs[0].shape))
    try:
        with torch.no_grad():
            out = module.macco_forward(make_batch(module))
    finally:
        hook.remove()
    masked = int(out.text_mask.sum())
    assert shapes == [(masked, 64)]  # never B x L x vocab
    with torch.no_grad():
        full = module.text_predictor.logits(out.text_predictor_features)  # [B, L, V]
    assert full.shape[:2] == out.text_mask.shape
    assert scaled_close(out.vocabulary_logits, full[out.text_mask], 1e-5)  # other matmul shapes: rounding only


def test_predictors_see_locals_averaged_with_their_own_sequences_global(module):
    """Text predictor: masked text with the masked EOS / full patches with the full CLS; image predictor: masked
    patches with the masked CLS / full text with the full EOS."""
    seen = {}
    hooks = [module.text_predictor.blocks[0].register_forward_pre_hook(
                 lambda mod, args: seen.update(text_queries=args[0], text_keys=args[1])),
             module.image_predictor.embed.register_forward_pre_hook(
                 lambda mod, args: seen.update(image_queries=args[0])),
             module.image_predictor.blocks[0].register_forward_pre_hook(
                 lambda mod, args: seen.update(image_keys=args[1]))]
    try:
        with torch.no_grad():
            out = module.macco_forward(make_batch(module))
    finally:
        for hook in hooks:
            hook.remove()
    average = lambda local, global_: (local + global_[:, None]) / 2  # noqa: E731
    assert torch.allclose(seen["text_queries"], average(out.masked_text.tokens, out.masked_text.pooled))
    assert torch.allclose(seen["text_keys"], average(out.image.patches, out.image.pooled))
    assert torch.allclose(seen["image_queries"], average(out.masked_image.patches, out.masked_image.pooled))
    assert torch.allclose(seen["image_keys"], average(out.text.tokens, out.text.pooled))
    eos = out.ids.argmax(dim=-1)
    assert torch.allclose(out.text.pooled, out.text.tokens[torch.arange(len(eos)), eos])  # global = EOS row


def reference_text_tokens(clip, ids, replace, mask_token):
    """open_clip's own modules: token embedding, replacement, THEN positions, causal tower, ln_final, projection."""
    x = torch.where(replace.unsqueeze(-1), mask_token, clip.token_embedding(ids)) + clip.positional_embedding
    x = clip.ln_final(clip.transformer(x, attn_mask=clip.attn_mask))
    return x @ clip.text_projection


def reference_image(visual, images, replace, mask_token):
    x = visual.conv1(images).flatten(2).transpose(1, 2)
    x = torch.where(replace.unsqueeze(-1), mask_token, x)
    x = torch.cat([visual.class_embedding.expand(x.shape[0], 1, -1), x], dim=1) + visual.positional_embedding
    x = visual.ln_post(visual.transformer(visual.ln_pre(x))) @ visual.proj
    return x[:, 0], x[:, 1:]


def test_mask_tokens_replace_embeddings_before_positions_through_the_module(module):
    batch = make_batch(module)
    with torch.no_grad():
        out = module.macco_forward(batch)
        length = out.ids.shape[1]
        assert length == int(batch["text"].argmax(dim=-1).max()) + 1  # trimmed after the last EOS
        assert torch.equal(out.masked_text.embeddings[out.text_mask],
                           module.text_mask_token.expand(int(out.text_mask.sum()), -1))
        full_mask = torch.zeros_like(batch["text"], dtype=torch.bool)
        full_mask[:, :length] = out.text_mask
        expected = reference_text_tokens(module.clip, batch["text"], full_mask, module.text_mask_token)
        # open_clip's forward against the module's (trimmed, explicit attention): ~1e-6 of the largest feature
        assert scaled_close(out.masked_text.tokens, expected[:, :length], 1e-5)
        assert scaled_close(out.text.pooled, module.clip.encode_text(batch["text"]), 1e-5)
        pooled, patches = reference_image(module.clip.visual, batch["image"], out.patch_mask, module.img_mask_token)
        assert scaled_close(out.masked_image.patches, patches, 1e-5)
        assert scaled_close(out.masked_image.pooled, pooled, 1e-5)
        assert scaled_close(out.image.pooled, module.clip.encode_image(batch["image"]), 1e-5)
        assert not scaled_close(out.masked_image.pooled, out.image.pooled, 1e-3)


def test_trimming_the_text_is_exact_with_the_key_padding_mask(module):
    batch = make_batch(module)
    with torch.no_grad():
        trimmed, _ = module.compute_terms(batch)
        module.trim_text = False
        try:
            full, _ = module.compute_terms(batch)
        finally:
            module.trim_text = True
    for name in trimmed:
        assert trimmed[name].item() == pytest.approx(full[name].item(), rel=1e-5, abs=1e-6), name


def plain_text_pair(module: MaccoCLIP):
    """The text forward without the memory savers: full and masked captions in one 2B forward at the full
    copy's length (the original's layout)."""
    def encode_text_pair(ids, text_mask, trim=True):
        replace = torch.cat([torch.zeros_like(text_mask), text_mask])
        both = module.encoders.encode_text(torch.cat([ids, ids]), replace=replace, mask_token=module.text_mask_token,
                                           trim=module.trim_text)
        return tuple(TextFeatures(pooled=p, tokens=t, embeddings=e) for p, t, e in
                     zip(both.pooled.chunk(2), both.tokens.chunk(2), both.embeddings.chunk(2)))
    return encode_text_pair


def terms_and_gradients(module: MaccoCLIP, batch: dict):
    terms, _ = module.compute_terms(batch)
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(total_loss(terms), [p for p in module.parameters() if p.requires_grad],
                                allow_unused=True)
    return {name: value.detach() for name, value in terms.items()}, dict(zip(names, grads))


@pytest.mark.parametrize("overrides", [["method.key_padding_mask=false"], []], ids=["paper", "ours"])
def test_memory_savers_change_no_loss_and_no_gradient(overrides, monkeypatch):
    """The masked caption stopped at the batch's last EOS and the towers recomputing their MLP activations in the
    backward, against the plain path (one 2B text forward at the full copy's length, every activation kept):
    the same four terms and the same gradient of every parameter, up to rounding (other matrix shapes)."""
    module = make_module(*overrides)
    batch = make_batch(module)
    assert module.encoders.recompute_activations
    with torch.no_grad():
        out = module.macco_forward(batch)
    assert out.masked_text.tokens.shape[1] == int(batch["text"].argmax(dim=-1).max()) + 1  # the saver is on
    saved_terms, saved_grads = terms_and_gradients(module, batch)
    module.encoders.recompute_activations = False
    monkeypatch.setattr(module, "encode_text_pair", plain_text_pair(module))
    with torch.no_grad():
        assert module.macco_forward(batch).masked_text.tokens.shape[1] == out.text.tokens.shape[1]
    plain_terms, plain_grads = terms_and_gradients(module, batch)
    assert saved_terms.keys() == plain_terms.keys()
    for name in plain_terms:
        assert saved_terms[name].item() == pytest.approx(plain_terms[name].item(), rel=1e-5, abs=0), name
    for name, plain in plain_grads.items():
        saved = saved_grads[name]
        assert (saved is None) == (plain is None), name
        assert saved is None or scaled_close(saved, plain, 1e-4), name


def test_without_the_key_padding_mask_every_text_position_is_a_key():
    module = make_module("method.key_padding_mask=false")
    assert not module.trim_text  # the original's 77 keys
    with torch.no_grad():
        out = module.macco_forward(make_batch(module))
    assert out.ids.shape[1] == 77


def test_key_padding_mask_hides_the_keys_after_eos(module):
    predictor = module.image_predictor
    ids = module.tokenizer(CAPTIONS)[:, :12]
    g = torch.Generator().manual_seed(4)
    queries, keys = torch.randn(4, GRID * GRID, 64, generator=g), torch.randn(4, 12, 64, generator=g)
    edited = keys.clone()
    padding = padding_positions(ids)
    assert padding[2].sum() == 12 - 4  # "a dog": SOT, a, dog, EOS; the 8 positions after EOS are padding
    edited[padding] = 100.0
    with torch.no_grad():
        assert scaled_close(predictor(queries, keys, padding), predictor(queries, edited, padding), 1e-5)
        assert not scaled_close(predictor(queries, keys), predictor(queries, edited), 1e-3)


def test_image_predictor_ends_with_two_layernorms_then_the_pixel_head():
    """As the original: its `ln`, then its head `proj` = LayerNorm + Linear (ours: ln_post, ln, head)."""
    module = make_module()
    predictor = module.image_predictor
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for ln in (predictor.ln_post, predictor.ln):  # affine away from (1, 0), so that each LayerNorm shows
            ln.weight.copy_(1 + 0.3 * torch.randn(64, generator=g))
            ln.bias.copy_(0.3 * torch.randn(64, generator=g))
        queries, keys = torch.randn(2, GRID * GRID, 64, generator=g), torch.randn(2, 9, 64, generator=g)
        blocks = run_stack(predictor.blocks, predictor.embed(queries) + predictor.positions, keys)
        expected = predictor.head(predictor.ln(predictor.ln_post(blocks)))
        assert scaled_close(predictor(queries, keys), expected, 1e-6)  # the same operations
        assert not scaled_close(predictor.head(predictor.ln(blocks)), expected, 1e-3)  # one LayerNorm less


def test_missing_masks_name_the_setting(module):
    batch = make_batch(module)
    del batch["patch_mask"]
    with pytest.raises(KeyError, match="data.masks=true"):
        module.compute_terms(batch)


# ----- optimisation groups and configs -------------------------------------------------------------------
def group_names(module: MaccoCLIP) -> dict:
    name_of = {id(p): n for n, p in module.named_parameters()}
    return {g["name"]: (g, {name_of[id(p)] for p in g["params"]}) for g in module.param_groups()}


def config_module(config: str) -> MaccoCLIP:
    cfg = load_run_config([REPO_ROOT / "configs" / config], ["model.name=ViT-Tiny-16-64", "model.pretrained=null"])
    torch.manual_seed(0)
    return MaccoCLIP(cfg)


def test_parameter_groups_of_the_paper_config_are_the_originals():
    """The original's AdamW: CLIP lr 5e-7 with wd 0.2, 0 for ndim < 2; every predictor tensor and both mask
    tokens lr 1e-3 with wd 0.01 (biases and LayerNorms too); logit_scale at the head's lr 1e-3 and wd 0.01."""
    module = config_module("macco.yaml")
    assert tuple(module.cfg.optim.betas) == (0.9, 0.999) and module.cfg.optim.eps == 1e-8
    groups = group_names(module)
    assert set(groups) == {"backbone", "backbone_no_decay", "head", "logit_scale"}
    settings = {name: (g["lr"], g["weight_decay"], g["warmup_steps"]) for name, (g, _) in groups.items()}
    assert settings == {"backbone": (5e-7, 0.2, 50), "backbone_no_decay": (5e-7, 0.0, 50), "head": (1e-3, 0.01, 50),
                        "logit_scale": (1e-3, 0.01, 50)}
    params = dict(module.named_parameters())
    clip = {n for n in params if n.startswith("encoders.model.") and n != "encoders.model.logit_scale"}
    assert groups["backbone"][1] == {n for n in clip if params[n].ndim >= 2}
    assert groups["backbone_no_decay"][1] == {n for n in clip if params[n].ndim < 2}
    head = set(params) - clip - {"encoders.model.logit_scale"}
    assert groups["head"][1] == head
    assert {"text_mask_token", "img_mask_token", "image_predictor.ln_post.weight", "image_predictor.head.bias",
            "text_predictor.ln.bias"} <= head
    assert all(n.startswith(("text_predictor.", "image_predictor.", "text_mask_token", "img_mask_token"))
               for n in head)
    assert groups["logit_scale"][1] == {"encoders.model.logit_scale"}


def test_parameter_groups_of_our_recipe():
    """[ours] no decay on 1-d head tensors, logit_scale with the CLIP weights (lr 5e-7, no decay)."""
    groups = group_names(config_module("macco_ours.yaml"))
    assert set(groups) == {"backbone", "backbone_no_decay", "head", "head_no_decay", "logit_scale"}
    assert (groups["head"][0]["weight_decay"], groups["head_no_decay"][0]["weight_decay"]) == (0.01, 0.0)
    assert {"text_mask_token", "img_mask_token", "image_predictor.ln_post.bias"} <= groups["head_no_decay"][1]
    assert "text_predictor.head.weight" in groups["head"][1]
    logit_scale, names = groups["logit_scale"]
    assert names == {"encoders.model.logit_scale"}
    assert (logit_scale["lr"], logit_scale["weight_decay"]) == (5e-7, 0.0)


def leaves(node, prefix: str = "") -> dict:
    """Dotted key -> value of every leaf of a nested dict (a config as a container)."""
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    return {k: v for key, child in node.items() for k, v in leaves(child, f"{prefix}{key}.").items()}


def test_configs_hold_the_recipe():
    paper = load_run_config([REPO_ROOT / "configs" / "macco.yaml"])
    assert paper.model.name == "ViT-B-32-quickgelu" and paper.model.pretrained == "openai"
    assert paper.data.masks and paper.preprocess.grounder == "groundingdino"
    assert (paper.trainer.max_epochs, paper.data.batch_size, paper.optim.warmup_steps) == (5, 256, 50)
    assert paper.trainer.precision == "bf16-mixed" and paper.trainer.strategy == "ddp"
    assert paper.checkpoint.monitor == "val/mca_loss"
    # the official code: no key padding mask, decay on every head tensor, logit_scale in the head group
    assert not paper.method.key_padding_mask
    assert paper.method.mca_masked == "both"
    assert paper.optim.head_decay_1d and paper.optim.logit_scale_group == "head"
    assert paper.data.comp_mask_rule == "first_bpe_match"  # the original's; every_occurrence is ours
    demo = load_run_config([REPO_ROOT / "configs" / "demo" / "macco.yaml"])
    assert demo.model.pretrained == "runs/demo_pretrain/export" and demo.trainer.max_steps == 100
    assert demo.method.name == "macco" and demo.data.masks


def test_our_recipe_differs_from_the_paper_config_only_in_our_options():
    paper, ours = (leaves(OmegaConf.to_container(load_run_config([REPO_ROOT / "configs" / name])))
                   for name in ("macco.yaml", "macco_ours.yaml"))
    differences = {key: (paper[key], ours[key]) for key in paper if paper[key] != ours[key]}
    assert differences == {"experiment": ("macco_coco", "macco_ours_coco"),
                           "method.key_padding_mask": (False, True),
                           "optim.logit_scale_group": ("head", "backbone"),
                           "optim.head_decay_1d": (True, False),
                           "data.out_of_crop_boxes": ("clamp", "drop"),
                           "data.box_aware_crop": (False, True),
                           "data.comp_mask_rule": ("first_bpe_match", "every_occurrence")}


# ----- a fit on the shapes world and its export ----------------------------------------------------------
def test_smoke_fit_with_masks_logs_the_report_and_exports_plain_open_clip(shapes_root, mask_cache,
                                                                          tmp_path, monkeypatch):
    monkeypatch.setitem(METHODS, "macco", MaccoCLIP)
    cfg = tiny_config(shapes_root, tmp_path, "method.name=macco", "data.masks=true",
                      f"preprocess.cache_root={mask_cache}", "checkpoint.monitor=val/mca_loss",
                      "trainer.max_steps=4", "trainer.limit_val_batches=1")  # 4 steps = 1 epoch: validation runs
    trainer = run(cfg)
    assert trainer.global_step == 4
    run_dir = tmp_path / "demo_pretrain"
    events = EventAccumulator(str(run_dir / "tb" / "version_0"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/mca_loss", "train/mir_loss", "train/mlm_loss", "train/mim_loss", "train/unweighted/mlm",
            "train/mask/text_tokens", "train/mask/image_patches", "train/mask/text_empty_fraction",
            "train/mask/image_empty_fraction", "val/mca_loss", "lr/head", "lr/logit_scale"} <= tags, tags
    assert all(e.value > 0 for e in events.Scalars("train/mask/text_tokens"))
    module = trainer.lightning_module.eval()
    export_dir = run_dir / "export"
    state = torch.load(export_dir / "open_clip.pt")
    assert not any("predictor" in k or "mask_token" in k for k in state)
    open_clip.add_model_config(export_dir / "model_configs")
    model, _, _ = open_clip.create_model_and_transforms("ViT-Tiny-16-64", pretrained=str(export_dir / "open_clip.pt"))
    model.eval()
    ids, images = module.tokenizer(CAPTIONS), torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        # open_clip's forward against the module's encoders: ~1e-6 of the largest feature
        assert scaled_close(model.encode_text(ids), module.encoders.encode_text(ids).pooled, 1e-5)
        assert scaled_close(model.encode_image(images), module.encoders.encode_image(images).pooled, 1e-5)
        # the same weights through the same forward
        assert scaled_close(load_export(export_dir).model.eval().encode_image(images), model.encode_image(images),
                            1e-6)


# ----- 2-process gloo parity of all four terms -------------------------------------------------------------
WORLD, LOCAL_BATCH = 2, 3
DDP_CAPTIONS = CAPTIONS + ["a blue car parked next to a tree", "two cats on a sofa"]
# Ranks with different numbers of valid samples: text masks 1 of 3 on rank 0, 3 of 3 on rank 1; patch masks
# 3 of 3 on rank 0, none on rank 1 (its local L_mim would be an empty mean).
DDP_TEXT_MASKED = [[2, 6], [], [], [2, 3], [3, 4, 5], [1, 3]]
DDP_PATCHES_MASKED = [[0, 1, 4], [10], list(range(8, 16)), [], [], []]
# Every parameter but the two 49408-row tables (token embedding, vocabulary head), whose gradients are large.
DDP_MAX_NUMEL = 1_000_000


def ddp_batch(module: MaccoCLIP) -> dict:
    ids = module.tokenizer(DDP_CAPTIONS)
    comp = torch.zeros_like(ids, dtype=torch.bool)
    patch = torch.zeros(len(DDP_CAPTIONS), GRID * GRID, dtype=torch.bool)
    for row, (tokens, patches) in enumerate(zip(DDP_TEXT_MASKED, DDP_PATCHES_MASKED)):
        comp[row, tokens] = True
        patch[row, patches] = True
    images = torch.randn(len(DDP_CAPTIONS), 3, 64, 64, generator=torch.Generator().manual_seed(5))
    return {"image": images, "text": ids, "comp_mask": comp, "patch_mask": patch}


def macco_terms_and_grads(rank_slice):
    """The four unweighted terms and each one's parameter gradients, on a slice of the global batch (all of it
    when None), with the paper's settings (no key padding mask)."""
    module = make_module("method.key_padding_mask=false")
    batch = ddp_batch(module)
    if rank_slice is not None:
        batch = {key: value[rank_slice] for key, value in batch.items()}
    raw = module.raw_losses(module.macco_forward(batch), batch["image"])
    params = {n: p for n, p in module.named_parameters() if p.numel() < DDP_MAX_NUMEL}
    grads = {}
    for term, value in raw.items():  # the same order on every rank: each backward all-reduces
        found = torch.autograd.grad(value, list(params.values()), retain_graph=True, allow_unused=True)
        grads[term] = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), found)}
    return {term: value.detach() for term, value in raw.items()}, grads


def _macco_worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        terms, grads = macco_terms_and_grads(slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH))
        # sync_dist logging and DDP: means over ranks
        for value in [*terms.values(), *(g for per_term in grads.values() for g in per_term.values())]:
            dist.all_reduce(value)
            value /= WORLD
        torch.save({"terms": terms, "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_all_four_terms_on_two_gloo_processes_equal_the_global_batch(tmp_path):
    """L_mca and L_mir gather features with gradient; L_mlm and L_mim average over the global set of valid
    samples, so ranks with different numbers of them (one with none) still give the global batch's terms and,
    after DDP's mean, its gradients."""
    mp.start_processes(_macco_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD,
                       start_method="spawn")
    expected_terms, expected_grads = macco_terms_and_grads(None)
    assert set(expected_terms) == {"mca", "mir", "mlm", "mim"}
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for term, value in expected_terms.items():
            # per-rank slices and all_reduce sums against one big batch: another summation order, ~1e-7 relative
            assert scaled_close(result["terms"][term], value, 1e-5), term
            for name, grad in expected_grads[term].items():
                assert scaled_close(result["grads"][term][name], grad, 1e-5), (term, name)
    reached = {term: {n for n, g in grads.items() if g.any()} for term, grads in expected_grads.items()}
    assert {"image_predictor.head.weight", "text_mask_token"} <= reached["mim"] | reached["mlm"]
    assert "image_predictor.ln_post.weight" in reached["mim"] and "text_predictor.ln.weight" in reached["mlm"]

"""SmartCLIP: modular losses against a slow reference, the straight-through mask, the mask network (the
official's all positions and QuickGELU, our caption positions), the detached mask network, the paper configs'
optimizer, exact parity under 2 real gloo processes, and a smoke fit on the tiny shapes world. Parity with the
official code on its golden fixture: test_smartclip_parity.py."""
from __future__ import annotations

import os
from types import SimpleNamespace

import lightning as L
import open_clip
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from fitting import a_batch, tiny_config

import lightning_modules
from core.config import REPO_ROOT
from lightning_modules import load_run_config
from modeling.export import load_export
from lightning_modules.base import total_loss
from lightning_modules.fit import run
from lightning_modules.methods.smartclip import (MaskNetwork, SmartCLIP, caption_positions, mask_network_heads,
                                         mask_network_positions, mask_report)
from modeling.modular_losses import (ModularContrastiveLoss, mask_sparsity, masked_logits,
                                              straight_through_mask)
from tolerance import scaled_close

BATCH, DIM, WORLD, NEGATIVES = 4, 6, 2, 2
CAPTIONS = ["a red cube to the left of a blue ball", "a man riding a horse", "a dog", "a small green triangle"]


# ----- the losses against their definition (docs/methods.md#modular-contrastive-loss), one anchor at a time -----
def reference_losses(images, texts, masks, tau, neg_texts=None, neg_masks=None):
    """sidm_i = CE_j(tau <norm(x_i m_j), t_j>, i); dism_i = CE_k(tau <norm(x_k m_i), t_i>, i). With NegCLIP's hard
    captions neg_texts [B, K, D] and their own masks: sidm's j also runs over all B * K of them after the B
    captions; dism is unchanged (they are never anchors)."""
    n = images.shape[0]
    columns = [(texts[j], masks[j]) for j in range(n)]
    if neg_texts is not None:
        columns += [(neg_texts[b, k], neg_masks[b, k]) for b in range(n) for k in range(neg_texts.shape[1])]
    sidm, dism = 0.0, 0.0
    for i in range(n):
        over_captions = torch.stack([tau * F.normalize(images[i] * mask, dim=0).dot(text) for text, mask in columns])
        sidm = sidm - (over_captions[i] - torch.logsumexp(over_captions, 0))
        over_images = torch.stack([tau * F.normalize(images[k] * masks[i], dim=0).dot(texts[i]) for k in range(n)])
        dism = dism - (over_images[i] - torch.logsumexp(over_images, 0))
    return sidm / n, dism / n


def random_inputs(binary: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(BATCH, DIM, generator=g, dtype=torch.float64)
    texts = F.normalize(torch.randn(BATCH, DIM, generator=g, dtype=torch.float64), dim=-1)
    masks = torch.rand(BATCH, DIM, generator=g, dtype=torch.float64)
    if binary:
        masks = (masks > 0.5).double()
        masks[1] = 0.0  # a caption whose mask keeps nothing: scores 0, finite gradients (F.normalize's eps)
    return [t.requires_grad_() for t in (images, texts, masks)]


@pytest.mark.parametrize("binary", [True, False])
def test_losses_and_gradients_match_the_slow_reference(binary):
    inputs = random_inputs(binary)
    sidm, dism = ModularContrastiveLoss(temperature=7.0)(*inputs)
    grads = torch.autograd.grad(sidm + 2 * dism, inputs)
    expected_sidm, expected_dism = reference_losses(*inputs, 7.0)  # in float64; the loss runs in float32
    expected_grads = torch.autograd.grad(expected_sidm + 2 * expected_dism, inputs)
    # float32 logits of size <= 7 (loss ~5): ~1e-7 relative
    assert scaled_close(sidm, expected_sidm, 1e-5) and scaled_close(dism, expected_dism, 1e-5)
    for grad, expected in zip(grads, expected_grads):
        assert torch.isfinite(grad).all()
        # row by row: the empty mask's row of the mask gradient is ~1e12 (F.normalize's eps), the others ~1;
        # float32 rounding is ~1e-6 of each row's largest entry (1.7e-6 seen)
        assert all(scaled_close(row, expected_row, 2e-5) for row, expected_row in zip(grad, expected))


def random_hard_captions(binary: bool, seed: int = 7):
    """Hard captions [B, K, D] (L2-normalised, float64) and their own masks; one hard caption keeps nothing."""
    g = torch.Generator().manual_seed(seed)
    texts = F.normalize(torch.randn(BATCH, NEGATIVES, DIM, generator=g, dtype=torch.float64), dim=-1)
    masks = torch.rand(BATCH, NEGATIVES, DIM, generator=g, dtype=torch.float64)
    if binary:
        masks = (masks > 0.5).double()
        masks[2, 1] = 0.0
    return [t.requires_grad_() for t in (texts, masks)]


@pytest.mark.parametrize("binary", [True, False])
def test_hard_negatives_are_extra_sidm_columns_under_their_own_masks(binary):
    """SmartCLIP + NegCLIP [ours]: losses and gradients against the float64 reference; dism is unchanged."""
    inputs, negatives = random_inputs(binary), random_hard_captions(binary)
    sidm, dism = ModularContrastiveLoss(temperature=7.0)(*inputs, *negatives)
    grads = torch.autograd.grad(sidm + 2 * dism, inputs + negatives)
    expected_sidm, expected_dism = reference_losses(*inputs, 7.0, *negatives)
    expected_grads = torch.autograd.grad(expected_sidm + 2 * expected_dism, inputs + negatives)
    # float32 logits of size <= 7 (loss ~5): ~1e-7 relative
    assert scaled_close(sidm, expected_sidm, 1e-5) and scaled_close(dism, expected_dism, 1e-5)
    for grad, expected in zip(grads, expected_grads):
        assert torch.isfinite(grad).all()
        # row by row, as above: an empty mask's row is ~1e12 (F.normalize's eps), the others ~1
        assert all(scaled_close(row, expected_row, 2e-5) for row, expected_row in zip(grad.flatten(0, -2),
                                                                                        expected.flatten(0, -2)))
    plain_sidm, plain_dism = ModularContrastiveLoss(temperature=7.0)(*inputs)
    assert torch.equal(dism, plain_dism) and sidm > plain_sidm + 0.05
    with pytest.raises(ValueError, match="together"):
        ModularContrastiveLoss(7.0)(*inputs, negatives[0])


def test_the_two_directions_differ_and_the_mask_changes_the_scores():
    images, texts, masks = random_inputs(binary=True)
    sidm, dism = ModularContrastiveLoss(100.0)(images, texts, masks)
    assert not torch.allclose(sidm, dism)  # rows and columns of S are different cross-entropies
    unmasked = masked_logits(images, torch.ones_like(masks), texts, 100.0)
    plain = 100.0 * F.normalize(images, dim=-1) @ texts.T  # an all-ones mask is plain CLIP
    assert torch.allclose(unmasked, plain)
    assert not torch.allclose(masked_logits(images, masks, texts, 100.0), plain)


def test_losses_in_fp32_under_bf16_autocast():
    images, texts, masks = (t.detach().bfloat16() for t in random_inputs(binary=True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sidm, dism = ModularContrastiveLoss(100.0)(images, texts, masks)
    assert sidm.dtype == dism.dtype == torch.float32
    expected = reference_losses(images.double(), texts.double(), masks.double(), 100.0)  # bf16 is exact in float64
    # float32 logits of size <= 100, losses ~70-90: ~1e-7 relative
    assert scaled_close(sidm, expected[0], 1e-5) and scaled_close(dism, expected[1], 1e-5)


def test_straight_through_mask_is_binary_with_the_sigmoid_gradient():
    logits = torch.tensor([[-2.0, -0.1, 0.0, 0.3, 4.0]], requires_grad=True)
    weights = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    hard = straight_through_mask(logits, hard=True)
    assert hard.tolist() == [[0.0, 0.0, 1.0, 1.0, 1.0]]  # sigmoid >= 0.5
    (grad,) = torch.autograd.grad((hard * weights).sum(), logits)
    soft = torch.sigmoid(logits.detach())
    assert torch.allclose(grad, weights * soft * (1 - soft))  # straight through: the sigmoid's gradient
    assert torch.allclose(straight_through_mask(logits, hard=False), torch.sigmoid(logits))
    assert mask_sparsity(hard).item() == pytest.approx(0.6)


# ----- 2-process gloo parity -------------------------------------------------------------------------------------
class TinySmartTowers(torch.nn.Module):
    """Image and text towers plus a mask network, reduced to Linear layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.image = torch.nn.Linear(8, DIM)
        self.text = torch.nn.Linear(5, DIM)
        self.mask = torch.nn.Linear(5, DIM)

    def forward(self, x_image, x_text, loss_fn, x_hard=None):
        masks = straight_through_mask(self.mask(x_text), hard=True)
        negatives = ()
        if x_hard is not None:  # NegCLIP's hard captions [B, K, 5], each under its own mask
            negatives = (F.normalize(self.text(x_hard), dim=-1), straight_through_mask(self.mask(x_hard), hard=True))
        sidm, dism = loss_fn(self.image(x_image), F.normalize(self.text(x_text), dim=-1), masks, *negatives)
        return {"sidm": sidm, "dism": dism, "sparsity": mask_sparsity(masks)}, mask_report(masks)


def parity_run(rank_slice, hard_negatives=False):
    """Losses, mask report and gradients on the slice of a fixed global batch (all of it if None)."""
    model, loss_fn = TinySmartTowers(), ModularContrastiveLoss(100.0)
    g = torch.Generator().manual_seed(123)
    x_image, x_text = torch.randn(BATCH * WORLD, 8, generator=g), torch.randn(BATCH * WORLD, 5, generator=g)
    x_hard = torch.randn(BATCH * WORLD, NEGATIVES, 5, generator=g) if hard_negatives else None
    if rank_slice is not None:
        x_image, x_text = x_image[rank_slice], x_text[rank_slice]
        x_hard = x_hard[rank_slice] if hard_negatives else None
    losses, report = model(x_image, x_text, loss_fn, x_hard)
    (10 * (losses["sidm"] + losses["dism"]) + 2 * losses["sparsity"]).backward()
    losses = {k: v.detach() for k, v in losses.items()}
    return losses, report, {n: p.grad.clone() for n, p in model.named_parameters()}


def _parity_worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        for hard_negatives in (False, True):  # one spawn for both: each backward all-reduces in the same order
            losses, report, grads = parity_run(slice(rank * BATCH, (rank + 1) * BATCH), hard_negatives)
            for value in [*losses.values(), *grads.values()]:  # sync_dist logging and DDP: means over ranks
                dist.all_reduce(value)
                value /= WORLD
            # the mask report is already global on every rank (logging's mean over ranks keeps it)
            torch.save({"losses": losses, "report": report, "grads": grads},
                       os.path.join(out_dir, f"rank{rank}_{hard_negatives}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_match_the_big_batch(tmp_path):
    """With and without hard negatives (gathered with their masks, extra sidm columns of every rank)."""
    mp.start_processes(_parity_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD,
                       start_method="spawn")
    for hard_negatives in (False, True):
        expected_losses, expected_report, expected_grads = parity_run(None, hard_negatives)
        assert expected_report["mask/active_min"] < expected_report["mask/active_max"]
        for rank in range(WORLD):
            result = torch.load(tmp_path / f"rank{rank}_{hard_negatives}.pt")
            # per-rank slices and all_reduce sums against one big batch: another summation order, ~1e-7 relative
            for name, value in expected_losses.items():
                assert scaled_close(result["losses"][name], value, 1e-5), name
            # exact: counts of the same hard masks (no mask logit lies within 6e-3 of the threshold, rounding is
            # ~1e-7)
            assert ({k: float(v) for k, v in result["report"].items()} ==
                    {k: float(v) for k, v in expected_report.items()})
            for name, grad in expected_grads.items():
                assert grad.abs().sum() > 0, name
                assert scaled_close(result["grads"][name], grad, 1e-5), (hard_negatives, name)


# ----- the mask network -------------------------------------------------------------------------------------------
PADDED_IDS = torch.tensor([[49406, 320, 1929, 49407, 0, 0], [49406, 320, 49407, 0, 0, 0]])


def with_changed_padding(tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    changed = tokens.clone()
    changed[~valid] = torch.randn(int((~valid).sum()), tokens.shape[-1]) * 10
    return changed


def test_mask_network_in_caption_mode_ignores_positions_after_eos_and_projects_only_when_widths_differ():
    torch.manual_seed(0)
    net = MaskNetwork(width=32, heads=2, embed_dim=16)
    assert isinstance(net.to_logits, torch.nn.Linear)
    assert isinstance(MaskNetwork(16, 2, 16).to_logits, torch.nn.Identity)
    valid = mask_network_positions(PADDED_IDS, "caption")
    assert torch.equal(valid, caption_positions(PADDED_IDS)) and valid.sum(dim=1).tolist() == [4, 3]
    tokens = torch.randn(2, 6, 32)
    changed = with_changed_padding(tokens, valid)
    logits = net(tokens, valid)
    assert logits.shape == (2, 16)
    assert scaled_close(net(changed, valid), logits, 1e-6)  # padded keys get exactly 0 attention
    changed[0, 1] += 1.0  # a real token does matter
    assert not scaled_close(net(changed, valid), logits, 1e-3)


def test_mask_network_in_the_official_mode_attends_to_and_pools_over_padding_too():
    torch.manual_seed(0)
    net = MaskNetwork(width=32, heads=2, embed_dim=32)
    assert mask_network_positions(PADDED_IDS, "all") is None
    tokens = torch.randn(2, 6, 32)
    logits = net(tokens)
    changed = with_changed_padding(tokens, caption_positions(PADDED_IDS))
    assert not scaled_close(net(changed), logits, 1e-3)
    # the reference: one pre-LN block with QuickGELU, no attention mask, softmax pooling over every position
    block = net.block
    x = tokens + block.attn(*[block.ln_1(tokens)] * 3, need_weights=False)[0]
    hidden = block.mlp.c_fc(block.ln_2(x))
    x = x + block.mlp.c_proj(hidden * torch.sigmoid(1.702 * hidden))
    weights = (x @ net.pool_score.weight.T).softmax(dim=1)
    assert scaled_close(logits, (weights * x).sum(dim=1), 1e-5)


def test_mask_network_heads_and_initialisation_as_the_original():
    assert [mask_network_heads(width) for width in (64, 128, 512, 768)] == [1, 2, 8, 12]
    assert mask_network_heads(32) == 1  # tiny towers: at least one head
    torch.manual_seed(0)
    width = 512
    net = MaskNetwork(width, mask_network_heads(width), width)
    block = net.block
    assert isinstance(block.mlp.gelu, open_clip.transformer.QuickGELU)
    expected_std = {block.attn.in_proj_weight: width ** -0.5, block.attn.out_proj.weight: (2 * width) ** -0.5,
                    block.mlp.c_fc.weight: (2 * width) ** -0.5, block.mlp.c_proj.weight: (2 * width) ** -0.5,
                    net.pool_score.weight: width ** -0.5}
    for weight, std in expected_std.items():
        sigmas = 4 / (2 * weight.numel()) ** 0.5  # 4 standard errors of a sample std: 12% at 512 draws, < 1% above
        assert weight.std().item() == pytest.approx(std, rel=sigmas)
        assert abs(weight.mean().item()) < 2 * sigmas * std
    assert torch.all(block.attn.in_proj_bias == 0) and torch.all(block.attn.out_proj.bias == 0)
    assert torch.all(block.ln_1.weight == 1) and torch.all(block.ln_1.bias == 0)


def smartclip_config(*overrides: str, files=()):
    return load_run_config(files, ["model.name=ViT-Tiny-16-64", "method.name=smartclip", *overrides])


@pytest.fixture(scope="module", params=["all", "caption"])
def module(request):
    torch.manual_seed(0)
    return SmartCLIP(smartclip_config("method.modular_weight=3.0", "method.sparsity_weight=0.5",
                                      f"method.mask_positions={request.param}")).train()


def hand_made_batch(module: SmartCLIP) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"image": torch.randn(len(CAPTIONS), 3, 64, 64, generator=g), "text": module.tokenizer(CAPTIONS)}


def test_terms_equal_the_reference_on_open_clips_own_forward(module):
    batch = hand_made_batch(module)
    module.zero_grad()
    terms, report = module.compute_terms(batch)
    with torch.no_grad():
        # reference: open_clip's untrimmed forward, the ln_final output read by a hook (test only); the mask network
        # on every context position [official] or on SOT..EOS [ours]
        captured = []
        handle = module.clip.ln_final.register_forward_hook(lambda _m, _i, out: captured.append(out))
        texts = F.normalize(module.clip.encode_text(batch["text"]), dim=-1)
        handle.remove()
        assert captured[0].shape[1] == module.clip.context_length
        positions = module.cfg.method.mask_positions
        logits = module.mask_net(captured[0], None if positions == "all" else caption_positions(batch["text"]))
        # the premise of comparing losses: no logit within rounding (~1e-6) of the threshold, where this untrimmed
        # forward's mask could differ from the module's (4e-4 is the smallest |logit|)
        assert logits.abs().min() > 1e-5
        masks = (torch.sigmoid(logits) >= 0.5).float()
        images = module.clip.encode_image(batch["image"])
        sidm, dism = reference_losses(images, texts, masks, 100.0)
    # cross-entropies of ~2-9 from logits of size ~100: the cancellation makes their rounding ~2e-6 relative
    assert terms["sidm_loss"].item() == pytest.approx(3.0 * sidm.item(), rel=2e-5)
    assert terms["dism_loss"].item() == pytest.approx(3.0 * dism.item(), rel=2e-5)
    assert terms["sparsity_loss"].item() == pytest.approx(0.5 * masks.mean().item(), rel=1e-6)  # a mean of 0s and 1s
    active = masks.sum(dim=1)
    assert 0 < active.min() < active.max() < masks.shape[1]  # the report can tell min from max
    assert [report[f"mask/active_{k}"].item() for k in ("mean", "min", "max")] == pytest.approx(
        [active.mean().item(), active.min().item(), active.max().item()])
    assert "unmasked_itc" not in report  # computed in validation only


# NegCLIP's hard captions of CAPTIONS (K = 2 per caption)
HARD_CAPTIONS = [["a blue cube to the left of a red ball", "a blue ball to the left of a red cube"],
                 ["a horse riding a man", "a man riding a camel"], ["a cat", "two dogs"],
                 ["a green small triangle", "a small red triangle"]]


def open_clip_text_and_masks(module: SmartCLIP, ids: torch.Tensor):
    """L2-normalised text embeddings and hard masks by open_clip's own untrimmed forward (the ln_final output read
    by a hook), the mask network on every position [official] or on SOT..EOS [ours]; and the smallest |logit|."""
    captured = []
    handle = module.clip.ln_final.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        texts = F.normalize(module.clip.encode_text(ids), dim=-1)
    finally:
        handle.remove()
    positions = module.cfg.method.mask_positions
    logits = module.mask_net(captured[0], None if positions == "all" else caption_positions(ids))
    return texts, (torch.sigmoid(logits) >= 0.5).float(), logits.abs().min()


@pytest.mark.parametrize("positions", ["all", "caption"])
def test_hard_negatives_join_sidm_under_their_own_masks_in_training_only(positions):
    """SmartCLIP + NegCLIP [ours]: sidm with the hard captions (open_clip's own forward, each under its own mask)
    equals the float64 reference; dism, sparsity, the mask report, validation and a run without the option are
    unchanged."""
    torch.manual_seed(0)
    negclip = SmartCLIP(smartclip_config("method.hard_negatives.captions=2",
                                         f"method.mask_positions={positions}")).train()
    torch.manual_seed(0)
    plain_module = SmartCLIP(smartclip_config(f"method.mask_positions={positions}")).train()
    batch = {**hand_made_batch(negclip),
             "neg_text": torch.stack([negclip.tokenizer(captions) for captions in HARD_CAPTIONS])}
    terms, report = negclip.compute_terms(batch)
    plain, plain_report = plain_module.compute_terms(batch)  # neg_text in the batch, option off: ignored
    without_negatives, _ = plain_module.compute_terms(hand_made_batch(plain_module))
    with torch.no_grad():
        texts, masks, margin = open_clip_text_and_masks(negclip, batch["text"])
        hard, hard_masks, hard_margin = open_clip_text_and_masks(negclip, batch["neg_text"].flatten(0, 1))
        # the premise of comparing losses: no logit within rounding of the threshold (see the test above)
        assert min(margin, hard_margin) > 1e-5
        images = negclip.clip.encode_image(batch["image"]).double()
        hard, hard_masks = hard.double().view(4, 2, -1), hard_masks.double().view(4, 2, -1)
        sidm, dism = reference_losses(images, texts.double(), masks.double(), 100.0, hard, hard_masks)
        plain_sidm, _ = reference_losses(images, texts.double(), masks.double(), 100.0)
    # cross-entropies of ~2-9 from logits of size ~100: the cancellation makes their rounding ~2e-6 relative
    assert terms["sidm_loss"].item() == pytest.approx(10 * sidm.item(), rel=2e-5)
    assert terms["dism_loss"].item() == pytest.approx(10 * dism.item(), rel=2e-5)
    assert plain["sidm_loss"].item() == pytest.approx(10 * plain_sidm.item(), rel=2e-5)
    assert sidm > plain_sidm + 0.01  # the hard captions are in the loss
    assert 0 < hard_masks.sum(dim=-1).min() < hard_masks.sum(dim=-1).max()  # their masks differ from caption to caption
    for name in ("dism_loss", "sparsity_loss"):  # the samples' own masks and directions: unchanged
        assert terms[name].item() == pytest.approx(plain[name].item(), rel=1e-6), name
    assert {k: v.item() for k, v in report.items()} == {k: v.item() for k, v in plain_report.items()}
    assert {k: v.item() for k, v in plain.items()} == {k: v.item() for k, v in without_negatives.items()}
    negclip.eval()
    with torch.no_grad():  # validation: the plain terms
        validation, _ = negclip.compute_terms(batch)
    assert validation["sidm_loss"].item() == pytest.approx(10 * plain_sidm.item(), rel=2e-5)


def test_hard_negatives_reach_the_text_encoder_and_the_mask_network_through_sidm():
    torch.manual_seed(0)
    negclip = SmartCLIP(smartclip_config("method.hard_negatives.captions=2")).train()
    batch = {**hand_made_batch(negclip),
             "neg_text": torch.stack([negclip.tokenizer(captions) for captions in HARD_CAPTIONS])}
    hard, hard_masks = negclip.hard_negatives_with_masks(batch)
    assert hard.shape == hard_masks.shape == (4, 2, 64) and hard.requires_grad and hard_masks.requires_grad
    # the hard masks read detached text features: their gradient trains the mask network only
    text_encoder = [p for n, p in negclip.clip.named_parameters() if not n.startswith("visual.") and p.requires_grad]
    assert all(g is None for g in torch.autograd.grad(hard_masks.sum(), text_encoder, retain_graph=True,
                                                      allow_unused=True))
    assert any(g is not None and g.abs().sum() > 0 for g in torch.autograd.grad(hard.sum(), text_encoder,
                                                                                allow_unused=True))


def test_the_mask_network_has_no_gradient_path_into_the_text_encoder(module):
    module.zero_grad()
    terms, _ = module.compute_terms(hand_made_batch(module))
    terms["sparsity_loss"].backward(retain_graph=True)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.mask_net.block.mlp.parameters())
    assert all(p.grad is None for p in module.clip.parameters()), "the mask must read detached text features"
    terms["sidm_loss"].backward()  # the contrastive terms do train the text encoder (through t, not the mask)
    assert module.clip.transformer.resblocks[0].attn.in_proj_weight.grad.abs().sum() > 0
    assert module.clip.logit_scale.grad is None and not module.clip.logit_scale.requires_grad


def test_validation_reports_the_unmasked_loss_at_the_fixed_temperature(module):
    batch = hand_made_batch(module)
    module.eval()
    try:
        with torch.no_grad():
            _, report = module.compute_terms(batch)
            images = F.normalize(module.clip.encode_image(batch["image"]), dim=-1)
            texts = F.normalize(module.clip.encode_text(batch["text"]), dim=-1)
    finally:
        module.train()
    logits = 100.0 * images @ texts.T
    labels = torch.arange(len(CAPTIONS))
    expected = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    assert report["unmasked_itc"].item() == pytest.approx(expected.item(), rel=2e-5)  # logits of size ~100, loss ~6


@pytest.mark.parametrize("config", ["smartclip.yaml", "smartclip_long.yaml"])
def test_the_paper_configs_optimizer_is_the_originals(config, monkeypatch):
    """The official: AdamW(betas (0.9, 0.999), eps 1e-8) on every CLIP parameter at lr 1e-6 with weight decay 0.01
    (gains, biases and the positional embedding too), 200 warmup steps then cosine to 0; a second AdamW on the
    mask network at lr 1e-3, wd 0, cosine to 0 without warmup; logit_scale never updated (temperature 100)."""
    torch.manual_seed(0)
    module = SmartCLIP(smartclip_config("model.pretrained=null", files=[REPO_ROOT / "configs" / config]))
    total_steps = 1000
    monkeypatch.setattr(SmartCLIP, "trainer", property(lambda self: SimpleNamespace(
        estimated_stepping_batches=total_steps)))
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert type(optimizer) is torch.optim.AdamW
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert set(groups) == {"backbone", "head"}  # no logit_scale group, no exempt gains or biases
    clip_parameters = [p for n, p in module.clip.named_parameters() if n != "logit_scale"]
    assert {id(p) for p in groups["backbone"]["params"]} == {id(p) for p in clip_parameters}
    assert {id(p) for p in groups["head"]["params"]} == {id(p) for p in module.mask_net.parameters()}
    assert not module.clip.logit_scale.requires_grad and module.modular.temperature == 100.0  # logit_scale unused
    for group, (lr, decay) in {"backbone": (1e-6, 0.01), "head": (1e-3, 0.0)}.items():
        settings = (groups[group]["weight_decay"], groups[group]["betas"], groups[group]["eps"])
        assert settings == (decay, (0.9, 0.999), 1e-8)
        assert groups[group]["initial_lr"] == lr
    backbone, head = (scheduler.lr_lambdas[list(groups).index(name)] for name in ("backbone", "head"))
    assert [backbone(step) for step in (0, 99, 199)] == pytest.approx([1 / 200, 100 / 200, 1.0])
    assert backbone(200 + (total_steps - 200) // 2) == pytest.approx(0.5) and backbone(total_steps) == 0.0
    assert head(0) == 1.0 and head(total_steps // 2) == pytest.approx(0.5) and head(total_steps) == 0.0


# ----- on the tiny shapes world -----------------------------------------------------------------------------------
@pytest.fixture
def registered(monkeypatch):
    """Register the method for fit (the lead adds it to lightning_modules.METHODS)."""
    monkeypatch.setitem(lightning_modules.METHODS, "smartclip", SmartCLIP)


def test_every_trainable_parameter_receives_a_gradient(shapes_root, tmp_path):  # noqa: F811
    cfg = tiny_config(shapes_root, tmp_path, "method.name=smartclip")
    L.seed_everything(0)
    module = SmartCLIP(cfg).train()
    terms, _ = module.compute_terms(a_batch(module, cfg))
    total_loss(terms).backward()
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    assert any(name.startswith("mask_net.") for name in names)
    for name, param in module.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name


def test_smoke_fit_trains_the_mask_network_and_exports_plain_clip(shapes_root, tmp_path, registered):  # noqa: F811
    cfg = tiny_config(shapes_root, tmp_path, "method.name=smartclip", "trainer.max_steps=4",
                      "optim.head_warmup_steps=0", "checkpoint.monitor=val/unmasked_itc")
    L.seed_everything(0)
    initial = {k: v.clone() for k, v in SmartCLIP(cfg).mask_net.state_dict().items()}
    trainer = run(cfg)
    module = trainer.lightning_module
    assert trainer.global_step == 4
    assert any(not torch.equal(initial[k], v) for k, v in module.mask_net.state_dict().items())
    run_dir = tmp_path / "demo_pretrain"
    assert len(list((run_dir / "checkpoints").glob("best-*.ckpt"))) == 1  # val/unmasked_itc was logged
    exported = torch.load(run_dir / "export" / "open_clip.pt")
    assert set(exported) == set(module.clip.state_dict())  # the mask network is not exported
    rebuilt = load_export(run_dir / "export").model.eval()  # plain open_clip, strict loading
    ids = module.tokenizer(["a red square left of a blue circle"])
    with torch.no_grad():
        assert scaled_close(rebuilt.encode_text(ids), module.clip.eval().encode_text(ids), 1e-6)  # the same forward
    events = EventAccumulator(str(run_dir / "tb" / "version_0"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/sidm_loss", "train/dism_loss", "train/sparsity_loss", "train/mask/active_mean",
            "train/mask/active_min", "train/mask/active_max", "val/unmasked_itc", "lr/head"} <= tags, tags

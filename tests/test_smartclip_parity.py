"""SmartCLIP against its official code: the golden fixture `tests/data/parity/smartclip/` (see its README), written
by `python -m testkit.parity.smartclip` from a checkout of the official code.

The fixture holds the official mask network's weights (official parameter names, `mapping.json` gives ours),
per-token text features at every position (padding after EOS included; the first caption fills the context and
has none), image and text features, and what the official code computed from them: mask logits, soft and hard
masks, sidm / dism / sparsity / total for hard and soft masks, and gradients of the total. Our MaskNetwork,
run as the paper config runs it, and our losses must reproduce all of it.

The official pool score `attn_pool.attention` has a bias; ours has none: a shift shared by all positions
cancels in the softmax over positions, so the bias changes nothing (its official gradient is ~0, checked below).
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tolerance import assert_scaled_close

from core.config import REPO_ROOT
from lightning_modules import load_run_config
from lightning_modules.base import total_loss
from lightning_modules.methods.smartclip import MaskNetwork, mask_network_heads, mask_network_positions, modular_terms
from modeling.modular_losses import ModularContrastiveLoss, straight_through_mask

FIXTURE = REPO_ROOT / "tests" / "data" / "parity" / "smartclip"
FIXTURE_FILES = ("fixture.safetensors", "weights.safetensors", "mapping.json", "expected.json")
REGENERATE = ("python -m testkit.parity.smartclip --official <checkout of reyuyu/SAID @ 729c5a6> "
              "--out tests/data/parity/smartclip")
POOL_BIAS = "mask_net.attn_pool.attention.bias"
# Tolerances, relative: fp32 rounding of the same computation by another path is ~1e-7 relative (measured on this
# fixture: 3.0e-7 on logits of up to 3.4, 6.4e-7 on loss terms of 0.5-2.3, 3.8e-6 on totals of ~30, and 7.6e-6
# on gradients of up to 27, at most 1.1e-6 of a gradient's largest |g|).
LOGITS_RTOL = 1e-5  # logits: within ~1e-5 of the largest |logit|
LOSS_RTOL = 1e-6  # loss terms of 0.5-2.3 and totals of ~30: ~2e-6 and ~6e-5 absolute
GRAD_RTOL = 5e-5  # gradients: within 1e-4 of the largest |g|


@pytest.fixture(scope="module")
def fixture():
    missing = [name for name in FIXTURE_FILES if not (FIXTURE / name).is_file()]
    if missing:  # committed with the repository: a damaged checkout, never a reason to skip
        pytest.fail(f"the SmartCLIP parity fixture lacks {', '.join(missing)} in {FIXTURE}: restore it with "
                    f"`git checkout -- tests/data/parity/smartclip`, or regenerate it with `{REGENERATE}`")
    return {"tensors": load_file(FIXTURE / "fixture.safetensors"),
            "weights": load_file(FIXTURE / "weights.safetensors"),
            "mapping": json.loads((FIXTURE / "mapping.json").read_text()),
            "expected": json.loads((FIXTURE / "expected.json").read_text())}


@pytest.fixture(scope="module")
def paper():
    """The method section of the paper config: which positions, which mask, weights and temperature."""
    return load_run_config([REPO_ROOT / "configs" / "smartclip_long.yaml"]).method


def official_mask_network(fixture) -> MaskNetwork:
    """Our MaskNetwork with the official weights, mapped by name (strict: every parameter of ours is set)."""
    expected = fixture["expected"]
    width, embed_dim = expected["width"], expected["embed_dim"]
    assert mask_network_heads(width) == expected["heads"]  # the original's rule, width // 64
    net = MaskNetwork(width, mask_network_heads(width), embed_dim)
    state = {}
    for official, tensor in fixture["weights"].items():
        ours = fixture["mapping"][official]
        if official == POOL_BIAS:  # no counterpart (module docstring)
            assert ours.startswith("no project counterpart")
            continue
        state[ours.removeprefix("mask_net.")] = tensor
    net.load_state_dict(state, strict=True)
    return net


def run_paper_recipe(fixture, paper, hard: bool):
    """Mask logits, masks, terms and total on the fixture's inputs, with gradients of the total."""
    tensors = fixture["tensors"]
    net = official_mask_network(fixture)
    images = tensors["image_features"].clone().requires_grad_()
    texts = tensors["text_features"].clone().requires_grad_()
    valid = mask_network_positions(tensors["token_ids"], paper.mask_positions)
    logits = net(tensors["token_features"], valid)
    logits.retain_grad()
    masks = straight_through_mask(logits, hard=hard)
    terms = modular_terms(images, F.normalize(texts, dim=-1), masks, ModularContrastiveLoss(paper.modular_temperature),
                          paper.modular_weight, paper.sparsity_weight)
    total = total_loss(terms)
    total.backward()
    grads = {"image_features": images.grad, "text_features": texts.grad, "mask_logits": logits.grad,
             "mask_net.resblocks.0.attn.in_proj_weight": net.block.attn.in_proj_weight.grad,
             "mask_net.attn_pool.attention.weight": net.pool_score.weight.grad}
    return logits.detach(), masks.detach(), terms, total, grads


def test_the_paper_config_is_the_fixtures_recipe(fixture, paper):
    expected = fixture["expected"]
    assert paper.mask_positions == "all" and paper.hard_mask
    weights = expected["weights"]
    assert (paper.modular_weight, paper.sparsity_weight) == (weights["sidm"], weights["sparsity"])
    assert expected["weights"]["sidm"] == expected["weights"]["dism"]
    assert paper.modular_temperature == expected["temperature"]
    ids = fixture["tensors"]["token_ids"]
    assert ids.argmax(dim=-1).tolist() == expected["eos_positions"]
    assert max(expected["eos_positions"]) == ids.shape[1] - 1 > min(expected["eos_positions"])  # full and padded


def test_mask_logits_and_masks_equal_the_official(fixture, paper):
    tensors = fixture["tensors"]
    logits, hard, _, _, _ = run_paper_recipe(fixture, paper, hard=True)
    assert_scaled_close(logits, tensors["mask_logits"], LOGITS_RTOL)
    assert torch.equal(hard, tensors["hard_mask"])  # every bit
    assert hard.sum(dim=1).tolist() == fixture["expected"]["hard"]["active_dims_per_sample"]
    assert_scaled_close(torch.sigmoid(logits), tensors["soft_mask"], LOGITS_RTOL)


@pytest.mark.parametrize("kind", ["hard", "soft"])
def test_losses_equal_the_official(fixture, paper, kind):
    _, _, terms, total, _ = run_paper_recipe(fixture, paper, hard=kind == "hard")
    expected = fixture["expected"][kind]
    assert_scaled_close(terms["sidm_loss"] / paper.modular_weight, expected["sidm"], LOSS_RTOL)
    assert_scaled_close(terms["dism_loss"] / paper.modular_weight, expected["dism"], LOSS_RTOL)
    assert_scaled_close(terms["sparsity_loss"] / paper.sparsity_weight, expected["sparsity"], LOSS_RTOL)
    assert_scaled_close(total, expected["total"], LOSS_RTOL)


def test_gradients_equal_the_official(fixture, paper):
    tensors = fixture["tensors"]
    _, _, _, _, grads = run_paper_recipe(fixture, paper, hard=True)
    for name, grad in grads.items():
        expected = tensors[f"grad_total/{name}"]
        assert expected.abs().max() > 0, name
        assert_scaled_close(grad, expected, GRAD_RTOL, msg=name)


def test_the_official_pool_bias_has_no_effect(fixture):
    """Why ours has no pool bias: its official gradient is rounding noise next to the pool weight's."""
    tensors = fixture["tensors"]
    bias_grad = tensors[f"grad_total/{POOL_BIAS}"].abs().max()
    assert bias_grad < 1e-5 * tensors["grad_total/mask_net.attn_pool.attention.weight"].abs().max()
    assert fixture["weights"][POOL_BIAS].abs().max() > 0.1  # a real shift (0.37), which the softmax cancels

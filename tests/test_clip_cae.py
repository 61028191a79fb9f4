"""CLIP-CAE: the attribution hinge against a slow reference, for every attribution method, and its gradients."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_modules.attribution import ATTRIBUTIONS, TextAttributionInputs, attribution_options, text_attribution
from lightning_modules.clip_cae import ClipCAE
from lightning_modules.config import load_config
from lightning_modules.losses import cae_attribution_loss
from parsers.scene_graph import SceneGraphParser
from parsers.token_alignment import caption_masks

CAPTIONS = ["a red cube to the left of a blue ball", "a man riding a horse", "a dog", "a small green triangle"]


def reference_hinge(attr_obj, attr_comp, valid, margin):
    values = [max(0.0, o - c + margin) for o, c, v in zip(attr_obj, attr_comp, valid) if v]
    return sum(values) / len(values) if values else 0.0


@pytest.mark.parametrize("margin", [0.0, 0.1])
def test_hinge_equals_a_loop_over_valid_captions(margin):
    attr_obj = torch.tensor([0.5, 0.2, 0.9, 0.3], requires_grad=True)
    attr_comp = torch.tensor([0.3, 0.4, 0.1, 0.3])
    valid = torch.tensor([True, True, False, True])
    loss = cae_attribution_loss(attr_obj, attr_comp, valid, margin)
    assert loss.item() == pytest.approx(reference_hinge(attr_obj.tolist(), attr_comp.tolist(), valid, margin))
    loss.backward()
    assert attr_obj.grad[2] == 0  # an invalid caption gets no gradient


def test_no_valid_caption_gives_zero_not_nan():
    attr_obj = torch.tensor([0.5, 0.2], requires_grad=True)
    loss = cae_attribution_loss(attr_obj, torch.zeros(2), torch.tensor([False, False]))
    assert loss.item() == 0.0 and loss.requires_grad


def make_module(method: str) -> ClipCAE:
    cfg = load_config([], ["model.name=ViT-Tiny-16-64", "method.name=clip_cae", f"method.attribution.name={method}",
                           "method.attribution.eclip_layers=2", "method.attr_weight=2.0", "method.attr_margin=0.5"])
    torch.manual_seed(0)
    return ClipCAE(cfg)


@pytest.fixture(scope="module")
def masks():
    graphs = SceneGraphParser().parse(CAPTIONS)
    return graphs


def make_batch(module: ClipCAE, graphs) -> dict:
    pairs = [caption_masks(c, g.object_spans(), g.composition_spans(), module.tokenizer)
             for c, g in zip(CAPTIONS, graphs)]
    generator = torch.Generator().manual_seed(1)
    return {"image": torch.randn(len(CAPTIONS), 3, 64, 64, generator=generator), "text": module.tokenizer(CAPTIONS),
            "obj_mask": torch.from_numpy(np.stack([p[0] for p in pairs])),
            "comp_mask": torch.from_numpy(np.stack([p[1] for p in pairs]))}


@pytest.mark.parametrize("method", list(ATTRIBUTIONS))
def test_attr_loss_equals_the_reference_and_reaches_the_text_encoder(method, masks):
    module = make_module(method).train()
    batch = make_batch(module, masks)
    terms, report = module.compute_terms(batch)
    # reference: the library's attribution (tested on its own) and a loop for the group means and the hinge
    image = torch.nn.functional.normalize(module.encoders.encode_image(batch["image"]).pooled, dim=-1)
    features = module.encoders.encode_text(batch["text"], attn=True)
    inputs = TextAttributionInputs(module.encoders, batch["text"], image, features, module.word_ends)
    a = text_attribution(method, inputs, attribution_options(module.cfg.method.attribution)).detach()
    obj, comp, valid = [], [], []
    for row, o_mask, c_mask in zip(a, batch["obj_mask"], batch["comp_mask"]):
        obj.append(float(row[o_mask].mean()) if o_mask.any() else 0.0)
        comp.append(float(row[c_mask].mean()) if c_mask.any() else 0.0)
        valid.append(bool(o_mask.any() and c_mask.any()))
    assert valid == [True, True, False, True]  # "a dog" has no composition word
    expected = 2.0 * reference_hinge(obj, comp, valid, 0.5)  # a wide margin: the hinge is active
    # float32 attributions of another forward: ~1e-6 relative (the hinge is active, far from its kink at 0)
    assert terms["attr_loss"].item() == pytest.approx(expected, rel=1e-5)
    kept = [i for i, v in enumerate(valid) if v]
    # a difference of means, possibly near 0: it rounds like the means, hence an atol of rtol times the largest
    assert float(report["attr/gap"]) == pytest.approx(np.mean([comp[i] - obj[i] for i in kept]), rel=1e-5,
                                                       abs=1e-5 * max(obj + comp))
    assert float(report["attr/valid_fraction"]) == 0.75
    module.zero_grad()
    terms["attr_loss"].backward()
    grad = module.clip.transformer.resblocks[-1].attn.in_proj_weight.grad
    assert expected > 0
    assert grad is not None and grad.abs().sum() > 0, "the attribution term must train the text encoder"


@pytest.mark.parametrize("method", ["gradient", "gradcam"])
def test_validation_under_no_grad_still_computes_gradient_attributions(method, masks):
    module = make_module(method).eval()
    with torch.no_grad():
        terms, report = module.compute_terms(make_batch(module, masks))
    assert torch.isfinite(terms["attr_loss"]) and torch.isfinite(report["attr/gap"])
    assert all(p.grad is None for p in module.parameters())


def test_missing_masks_name_the_setting(masks):
    module = make_module("attention")
    batch = make_batch(module, masks)
    del batch["obj_mask"]
    with pytest.raises(KeyError, match="data.masks=true"):
        module.compute_terms(batch)
